"""archive_view.py: what a proposer is shown of the archive (harness_archive.py holds the files).

    archive_digest(archive_dir, max_chars) -> str   # the LLM proposers' view, most important first
    render_trace(record, limit) -> str              # one rollout as text: calls in and out, tools, outcome
    outcomes_vs(cand, parent) -> (won, lost)        # example ids a candidate won / lost against its parent
    source_diff(parent_src, src) -> str             # a unified diff of two harness sources
    RULES                                           # the paper's proposer rules, shown to every LLM proposer

Both kinds of LLM proposer use it: the self/openai proposers (proposers.py) put the digest in their
prompt, and the command proposer (agent_proposer.py) writes the same pieces as files into the
agent's copy of the archive. Everything here reads the harness split's archive only: scores,
sources, traces; never reference answers or the test split. Left out: any ranking of its own (the
order is harness_archive.rank_key's) and token counting (budgets are in characters).
"""
import difflib

from harness_search import harness_archive

DIGEST_CHARS = 16000           # default budget of the LLM proposers' archive view

RULES = """Rules (from the paper's proposer skill):
- Each harness file implements ONE mechanism (one idea about prompting, tool use, parsing,
  feedback or stopping), different from the other candidates of this iteration.
- Or a MERGE: the parent with the changes of two earlier candidates that each held or helped against
  their own parents (their diffs are below), when they changed different things. Start the docstring
  with "merge of cand_A and cand_B". A merge brings together mechanisms already in the archive; a new
  mechanism is still one per candidate.
- No pure parameter tweaks: changing only a number (top-k, a turn limit, a length) is not a
  mechanism.
- Never hard-code answers, examples, or dataset names; the harness must work on unseen tasks.
- Import only the Python standard library.
- Keep the entry point `def run(task, llm, tools)` returning the final answer (str or None).
  `llm(messages, max_tokens=256, stop=None, n=None)` returns the reply text; n=k returns k
  replies to the same prompt, sampled together (cheaper than k calls; each counts as a call).
  The harness may not touch the model, the data, the verifier, or the environment's rules
  (in chess the model chooses the moves, never the harness).
- You never run the benchmark yourself; you only write harness files."""


def short(x, n):
    """str(x) cut to n characters, saying how many were cut."""
    s = str(x)
    n = max(0, int(n))
    return s if len(s) <= n else s[:n] + f" ...[{len(s) - n} more chars]"


def render_trace(r, limit=1500):
    """One rollout as text: outcome, then each model call (last message in, text out), tools."""
    parts = [f"### example {r.get('example_id')}: score {r.get('score')}, status {r.get('status')}, "
             f"turns {r.get('turns')}, answer {short(repr(r.get('answer')), 200)}"]
    if r.get("error"):
        parts.append("error: " + short(r["error"], 300))
    for i, call in enumerate(r.get("calls") or []):
        msgs = call.get("messages") if isinstance(call, dict) else None
        last = msgs[-1].get("content") if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) \
            else msgs if msgs is not None else call
        parts.append(f"[llm call {i + 1}] last message in: {short(last, 500)}")
        if isinstance(call, dict):
            parts.append(f"[llm call {i + 1}] reply: {short(call.get('text'), 400)}")
    for t in r.get("tool_calls") or []:
        if isinstance(t, dict):
            args = [repr(a) for a in t.get("args") or ()] + \
                [f"{k}={v!r}" for k, v in (t.get("kwargs") or {}).items()]
            parts.append(f"[tool] {t.get('name')}({short(', '.join(args), 200)}) -> "
                         f"{short(t.get('error') or t.get('result'), 300)}")
    return short("\n".join(parts), limit)


def outcomes_vs(cand, parent):
    """(won, lost): the example ids on which `cand` scored above / below `parent` (both
    scored on the same examples in the same order), or None when they cannot be paired."""
    a, b = cand.get("scores") or {}, parent.get("scores") or {}
    if not a or not b or a.get("example_ids") != b.get("example_ids"):
        return None
    rows = list(zip(a["example_ids"], a["per_example"], b["per_example"]))
    return [i for i, x, y in rows if x > y], [i for i, x, y in rows if x < y]


def source_diff(parent_src, src, a="parent", b="candidate", context=1):
    """Unified diff of two sources (difflib), a few lines of context."""
    def lines(s):
        s = s if s.endswith("\n") else s + "\n"
        return s.splitlines(keepends=True)
    return "".join(difflib.unified_diff(lines(parent_src), lines(src), a, b, n=context))


def id_list(xs, n=12):
    """The first n ids, comma-separated, and how many more there are."""
    return ", ".join(map(str, xs[:n])) + (f" (+{len(xs) - n} more)" if len(xs) > n else "") if xs else "none"


def archive_digest(archive_dir, max_chars=DIGEST_CHARS, n_diffs=4, n_trace_cands=3, with_traces=True):
    """What an LLM proposer sees, within max_chars, most important first (each part gets a
    share of what the earlier parts left): the leaderboard and the rejected candidates with
    their reasons; the full source of the best candidate (the parent that edit blocks apply
    to); the top candidates' diffs against their parents, each with its score, its parent's,
    and the examples it won and lost against that parent; failed traces from the top
    n_trace_cands candidates (on an example the candidate lost to its parent when there is
    one) and one successful trace of the best. Full traces stay on disk."""
    archive = harness_archive.load_archive(archive_dir)
    by_name = {c["name"]: c for c in archive}
    scored = sorted(harness_archive.scored_whole(archive), key=harness_archive.rank_key)
    rows = ["## Archive, best first (success desc, mean turns asc)",
            "cand | success | mean turns | mean tokens | proposer | parent | mechanism"]
    for c in scored[:20]:
        s, m = c["scores"], c["meta"]
        rows.append(f"{c['name']} | {s['success']:.3f} | {s['mean_turns']:.2f} | {s['mean_tokens']:.0f} | "
                    f"{m.get('proposer')} | {m.get('parent')} | {short(m.get('note', ''), 160)}")
    if len(scored) > 20:
        rows.append(f"... and {len(scored) - 20} more (scores.json of each)")
    dropped = [c for c in archive if c["scores"] and c["scores"].get("dropped_after")][-8:]
    if dropped:  # raced and dropped: a score over the first examples only, not in the order above
        rows.append("\nDropped early (little chance left to beat the incumbent): " + "; ".join(
            f"{c['name']} {c['scores']['success']:.3f} on the first {c['scores']['dropped_after']} examples "
            f"({short(c['meta'].get('note', ''), 80)})" for c in dropped))
    bad = [c for c in archive if c["invalid"]][-8:]
    if bad:
        rows.append("\nRejected (invalid): " + "; ".join(
            f"{c['name']}: {short(c['invalid'].strip(), 160)}" for c in bad))
    text = short("\n".join(rows), max_chars // 4)
    if not scored:
        return text
    best = scored[0]
    left = max_chars - len(text)
    src = best["source"] if best["source"].endswith("\n") else best["source"] + "\n"
    text += (f"\n\n## The parent: full source of the best candidate, {best['name']} "
             f"(edit blocks apply to this text)\n```python\n{short(src, int(left * 0.6))}```\n")

    diffs = []
    for c in scored[:n_diffs + 1]:
        parent = by_name.get(c["meta"].get("parent") or "")
        if c["num"] == 0 or parent is None or not parent["scores"]:
            continue
        wl = outcomes_vs(c, parent)
        won, lost = wl if wl else ([], [])
        diffs.append((f"### {c['name']}: success {c['scores']['success']:.3f} vs its parent {parent['name']} "
                      f"{parent['scores']['success']:.3f}; better on {len(won)}, worse on {len(lost)} of "
                      f"{c['scores']['n']} examples\nbetter on: {id_list(won)}\nworse on: {id_list(lost)}\n",
                      source_diff(parent["source"], c["source"], parent["name"], c["name"])))
    if diffs:
        share = (max_chars - len(text)) * 0.5 / len(diffs)
        text += "\n## What the top candidates changed, and on which examples it won or lost\n" + "".join(
            f"{head}```diff\n{short(d, share - len(head) - 12)}```\n" for head, d in diffs[:n_diffs])

    if with_traces:
        shown = []
        for c in scored[:n_trace_cands]:
            recs = harness_archive.read_traces(c)
            parent = by_name.get(c["meta"].get("parent") or "")
            wl = outcomes_vs(c, parent) if parent else None
            lost = set(wl[1]) if wl else set()
            failed = sorted((r for r in recs if float(r.get("score") or 0) < 0.5),
                            key=lambda r: str(r.get("example_id")) not in lost)
            shown += [(c["name"], "failed", r) for r in failed[:2 if c is best else 1]]
            if c is best:
                shown += [(c["name"], "successful", r) for r in recs if float(r.get("score") or 0) >= 0.5][:1]
        budget = max_chars - len(text)
        if shown and budget > 300:
            per = budget // len(shown) - 40
            text += "\n## Traces (failed ones from several candidates, one successful of the best)\n" + "\n\n".join(
                f"[{name}, {kind}]\n{render_trace(r, per)}" for name, kind, r in shown)
    return text[:max_chars]
