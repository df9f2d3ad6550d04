"""proposers.py: who writes the harness candidates of phase B (meta_harness.py runs the search).

One interface: propose(archive_dir, k) -> [dict(source, proposer, note, [parent, axis, raw])],
with .stats (calls, chars, tokens, seconds) and .errors (what went wrong in the last call).
  primitives  offline default: the archive's best with ONE axis (a top-level name) replaced by
              one of domain.PRIMITIVES' alternatives, spliced in by name with `ast`; the axis is
              chosen from the failure signatures of that candidate's failed traces;
  self        the policy model writes candidates from an archive digest (llm_text callable);
  openai      the same prompt to any OpenAI-compatible /chat/completions endpoint (urllib);
  command     an external coding agent (e.g. "claude -p") run inside the archive directory,
              as in the paper: it reads the files it wants and writes new/*.py.

A proposer reads only the archive (harness-split traces, scores, sources), never the
reference answers or the test split. What it leaves out: parallel proposer calls, retries
of a failed LLM call within one iteration (the iteration just gets fewer candidates).
"""

import ast
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter

import meta_harness as mh

# -----------------------------------------------------------------------------
# Proposer: primitives (offline, deterministic)

# Which axes a failure points at. A failed rollout gets ONE signature from its trace (the
# record has no reference answer, by design), and an axis matches a signature when a
# keyword occurs in its name. This works for any domain whose axis names say what they do
# (SYSTEM_PROMPT, extract_answer, TOP_K, format_feedback, MAX_TURNS, ...).
SIGNATURE_KEYWORDS = {
    # the harness crashed, timed out, or a tool call raised (chess: an illegal move)
    "error": ("retry", "nudge", "recover", "error", "feedback", "fallback", "legal", "parse", "turn"),
    # the rollout ended with no answer: parsing or stopping lost it
    "no_answer": ("extract", "parse", "answer", "recover", "final", "stop", "turn", "budget", "format"),
    # answered without using any tool: the prompts must ask for the tool
    "no_tool": ("system", "prompt", "template", "user", "instruction", "nudge", "tool"),
    # answered wrong while the tool output the model saw was cut short ("..." at a line end,
    # the mark the domains' tools put on a cut): the answer may sit in the part it never saw
    "truncated": ("retriev", "chars", "length", "context", "top", "k", "observation", "feedback"),
    # answered, but the answer is nowhere in the tool output: retrieval / tool use missed it
    "unsupported": ("search", "query", "retriev", "rewrite", "top", "k", "passage", "chars",
                    "context", "code", "python", "observation", "feedback"),
    # the answer came from the tool output and was still wrong: instructions / format
    "wrong": ("system", "prompt", "template", "user", "instruction", "format", "extract", "answer"),
}


# a line that ends in "..." or "...[output truncated]": how searchqa and math mark a cut tool output
CUT_MARK = re.compile(r"\.\.\.(\[[^\]\n]*\])?[ \t]*$", re.M)


def _norm_text(x):
    return re.sub(r"\s+", " ", str(x)).strip().lower()


def failure_signatures(records):
    """Counter of signatures over the failed rollouts (score < 0.5) of one candidate."""
    sig = Counter()
    for r in records:
        if float(r.get("score") or 0) >= 0.5:
            continue
        tools = r.get("tool_calls") or []
        answer = r.get("answer")
        if r.get("status") not in (None, "ok") or any(t.get("error") for t in tools):
            sig["error"] += 1
        elif answer is None or not str(answer).strip():
            sig["no_answer"] += 1
        elif not tools:
            sig["no_tool"] += 1
        elif any(CUT_MARK.search(str(t.get("result", ""))) for t in tools):
            sig["truncated"] += 1
        elif _norm_text(answer) not in " ".join(_norm_text(t.get("result", "")) for t in tools):
            sig["unsupported"] += 1
        else:
            sig["wrong"] += 1
    return sig


def axis_matches(axis, signature):
    words = axis.lower().split("_")
    return any(kw in words or (len(kw) > 3 and kw in axis.lower()) for kw in SIGNATURE_KEYWORDS[signature])


def axis_weight(axis, signatures):
    """How many failed rollouts point at this axis."""
    return sum(n for s, n in signatures.items() if axis_matches(axis, s))


def rank_axes(axes, signatures, tried, rng):
    """Axes by how many failures point at them, divided by 1 + how often they were already
    tried (so a favourite does not starve the rest); then untried before tried; then a
    seeded coin. With no failure signal this is "untried axes first, in random order"."""
    return sorted(axes, key=lambda a: (-axis_weight(a, signatures) / (1 + tried[a]), tried[a], rng.random()))


def _primitives_proposer(domain, rng_seed):
    def propose(archive_dir, k):
        propose.errors = []
        archive = mh.load_archive(archive_dir)
        parent = mh.paper_best(archive)
        if parent is None:
            propose.errors.append("primitives: no evaluated candidate to start from")
            return []
        allowed = (mh.read_json(os.path.join(archive_dir, "rules.json"), {}) or {}).get("allowed_axes")
        spans = mh.top_level_names(parent["source"])
        axes = [a for a in domain.PRIMITIVES if a in spans and (allowed is None or a in allowed)]
        signatures = failure_signatures(mh.read_traces(parent))
        tried = Counter(c["meta"].get("axis") for c in archive)
        # Seeded by the archive size: the same archive gives the same proposals, so a resumed
        # search proposes what the crashed one would have.
        rng = random.Random(f"{rng_seed}:{len(archive)}")
        seen = {mh.normalized(c["source"]) for c in archive}
        queues = {}
        for axis in rank_axes(axes, signatures, tried, rng):
            alts = list(enumerate(domain.PRIMITIVES[axis]))
            rng.shuffle(alts)
            queues[axis] = []
            for j, alt in alts:
                try:
                    src = mh.splice(parent["source"], axis, alt)
                except (ValueError, KeyError, SyntaxError) as e:
                    propose.errors.append(f"primitives: {axis} alternative {j}: {e}")
                    continue
                queues[axis].append((j, src))
        # One candidate per axis first (k different mechanisms), then second choices, ...; but
        # when one axis explains most failures (over half of them, and it was never tried),
        # its second alternative comes before the other axes' first: one draw of a clearly
        # implicated axis is a poor test of it
        out, order = [], list(queues)
        top = order[0] if order else None
        if top and not tried[top] and 2 * axis_weight(top, signatures) > sum(signatures.values()):
            order.insert(1, top)
        while len(out) < k and any(queues.values()):
            for axis in order:
                q = queues[axis]
                while q and len(out) < k:
                    j, src = q.pop(0)
                    if mh.normalized(src) in seen:  # never repeat an archived source
                        continue
                    seen.add(mh.normalized(src))
                    hint = ", ".join(f"{s} x{n}" for s, n in signatures.most_common()) or "none"
                    out.append(dict(source=src, proposer="primitives", parent=parent["name"], axis=axis,
                                    note=f"{axis}: alternative {j + 1}/{len(domain.PRIMITIVES[axis])} "
                                         f"on {parent['name']} (failures of the parent: {hint})"))
                    break
            order = list(queues)  # later rounds: one more per axis, in rank order
        if not out:
            propose.errors.append("primitives: every alternative of every allowed axis is in the archive")
        return out
    propose.stats, propose.errors = dict(calls=0), []
    return propose


# -----------------------------------------------------------------------------
# LLM proposers: the archive digest and the prompt

RULES = """Rules (from the paper's proposer skill):
- Each harness file implements ONE mechanism (one idea about prompting, tool use, parsing,
  feedback or stopping), different from the other candidates of this iteration.
- No pure parameter tweaks: changing only a number (top-k, a turn limit, a length) is not a
  mechanism.
- Never hard-code answers, examples, or dataset names; the harness must work on unseen tasks.
- Import only the Python standard library.
- Keep the entry point `def run(task, llm, tools)` returning the final answer (str or None).
  The harness may not touch the model, the data, the verifier, or the environment's rules
  (in chess the model chooses the moves, never the harness).
- You never run the benchmark yourself; you only write harness files."""


def _short(x, n):
    s = str(x)
    return s if len(s) <= n else s[:n] + f" ...[{len(s) - n} more chars]"


def render_trace(r, limit=1500):
    """One rollout as text: outcome, then each model call (last message in, text out), tools."""
    parts = [f"### example {r.get('example_id')}: score {r.get('score')}, status {r.get('status')}, "
             f"turns {r.get('turns')}, answer {_short(repr(r.get('answer')), 200)}"]
    if r.get("error"):
        parts.append("error: " + _short(r["error"], 300))
    for i, call in enumerate(r.get("calls") or []):
        msgs = call.get("messages") if isinstance(call, dict) else None
        last = msgs[-1].get("content") if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) \
            else msgs if msgs is not None else call
        parts.append(f"[llm call {i + 1}] last message in: {_short(last, 500)}")
        if isinstance(call, dict):
            parts.append(f"[llm call {i + 1}] reply: {_short(call.get('text'), 400)}")
    for t in r.get("tool_calls") or []:
        if isinstance(t, dict):
            args = [repr(a) for a in t.get("args") or ()] + \
                [f"{k}={v!r}" for k, v in (t.get("kwargs") or {}).items()]
            parts.append(f"[tool] {t.get('name')}({_short(', '.join(args), 200)}) -> "
                         f"{_short(t.get('error') or t.get('result'), 300)}")
    return _short("\n".join(parts), limit)


def archive_digest(archive_dir, max_chars=12000, n_traces=4):
    """What an LLM proposer sees: the leaderboard, the invalid ones and why, the best source,
    and a few failed and successful traces of the best (full traces stay on disk)."""
    archive = mh.load_archive(archive_dir)
    scored = sorted((c for c in archive if c["scores"]), key=mh.rank_key)
    rows = ["## Archive, best first (success desc, mean turns asc)",
            "cand | success | mean turns | mean tokens | proposer | parent | mechanism"]
    for c in scored[:30]:
        s, m = c["scores"], c["meta"]
        rows.append(f"{c['name']} | {s['success']:.3f} | {s['mean_turns']:.2f} | {s['mean_tokens']:.0f} | "
                    f"{m.get('proposer')} | {m.get('parent')} | {_short(m.get('note', ''), 160)}")
    bad = [c for c in archive if c["invalid"]][-10:]
    if bad:
        rows.append("\nRejected (invalid): " + "; ".join(
            f"{c['name']}: {_short(c['invalid'].strip(), 160)}" for c in bad))
    text = "\n".join(rows)
    if not scored:
        return text
    best = scored[0]
    text += f"\n\n## Source of the best candidate, {best['name']}\n```python\n" \
            f"{_short(best['source'], max_chars // 2)}\n```\n"
    recs = mh.read_traces(best)
    failed = [r for r in recs if float(r.get("score") or 0) < 0.5][: (n_traces + 1) // 2]
    good = [r for r in recs if float(r.get("score") or 0) >= 0.5][: n_traces // 2]
    budget = max(0, max_chars - len(text))
    shown = failed + good
    if shown and budget > 200:
        per = budget // len(shown)
        text += f"\n## Traces of {best['name']} (failed first, then successful)\n" + \
            "\n\n".join(render_trace(r, per - 2) for r in shown)
    return text


def build_prompt(domain, archive_dir, i, k, notes, digest_chars=12000):
    rules = (mh.read_json(os.path.join(archive_dir, "rules.json"), {}) or {})
    allowed = rules.get("allowed_axes")
    restrict = "" if allowed is None else (
        f"\n- PROMPT-ONLY SEARCH: change ONLY the top-level definitions {allowed} of the best "
        "candidate; every other top-level definition must stay exactly as it is.")
    done = "".join(f"\n- {n}" for n in notes) or " (none yet)"
    return (f"You improve the harness (the Python code around a language model) of an agent.\n\n"
            f"## Task\n{domain.SKILL}\n\n{RULES}{restrict}\n\n{archive_digest(archive_dir, digest_chars)}\n\n"
            f"## Your job\nWrite candidate {i + 1} of {k} for this iteration. Mechanisms already "
            f"proposed this iteration:{done}\nReply with one line `Mechanism: <one sentence>`, then the "
            f"complete new harness file in a single ```python block.")


def extract_code(text):
    """The last ```python block that defines run (else the last block); "" if none. A closing
    fence must stand on its own line, so a harness that itself parses ``` in model output is
    not cut in half."""
    text = re.sub(r"<think>.*?</think>", "", str(text), flags=re.S)
    blocks = re.findall(r"^```(?:python|py)?[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.S | re.M)
    with_run = [b for b in blocks if re.search(r"^def run\(", b, re.M)]
    code = (with_run or blocks or [""])[-1]
    return code.strip("\n") + "\n" if code.strip() else ""


def extract_note(text):
    m = re.search(r"Mechanism:\s*(.+)", re.sub(r"<think>.*?</think>", "", str(text), flags=re.S))
    return m.group(1).strip()[:300] if m else "(no Mechanism: line)"


def _llm_proposer(name, domain, ask, digest_chars, transport_errors=()):
    """Shared by self and openai: K independent calls, each told what the earlier ones chose.
    ask(prompt) -> (text, usage dict). A failed call costs its candidate, never the run; a
    transport failure (endpoint down) ends the batch instead of waiting out K timeouts."""
    def propose(archive_dir, k):
        propose.errors = []
        best = mh.paper_best(mh.load_archive(archive_dir))
        out, notes = [], []
        for i in range(k):
            prompt = build_prompt(domain, archive_dir, i, k, notes, digest_chars)
            propose.stats["calls"] += 1
            propose.stats["prompt_chars"] += len(prompt)
            t0 = time.time()
            try:
                text, usage = ask(prompt)
            except Exception as e:
                propose.errors.append(f"{name} call {i + 1}/{k}: {type(e).__name__}: {_short(e, 300)}")
                if isinstance(e, transport_errors):
                    break
                continue
            finally:
                propose.stats["seconds"] += time.time() - t0
            propose.stats["completion_chars"] += len(text)
            propose.stats["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
            propose.stats["completion_tokens"] += int(usage.get("completion_tokens") or 0)
            note = extract_note(text)
            notes.append(note)
            out.append(dict(source=extract_code(text), proposer=name, note=note, raw=text,
                            parent=best["name"] if best else None))
        return out
    propose.stats = dict(calls=0, prompt_chars=0, completion_chars=0, prompt_tokens=0,
                         completion_tokens=0, seconds=0.0)
    propose.errors = []
    return propose


def _openai_ask(base_url, model, api_key, max_tokens, timeout):
    base = base_url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    chosen = [model]

    def get_model():
        # vLLM and Ollama want the served model's name; if none was given, ask the server.
        if chosen[0] is None:
            req = urllib.request.Request(base + "/models", headers=headers)
            with urllib.request.urlopen(req, timeout=timeout) as r:
                chosen[0] = json.loads(r.read().decode("utf-8", "replace"))["data"][0]["id"]
        return chosen[0]

    def ask(prompt):
        body = dict(model=get_model(), messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
        req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.loads(r.read().decode("utf-8", "replace"))
        text = data["choices"][0]["message"]["content"]
        if not isinstance(text, str):
            raise ValueError("reply has no text content")
        return text, data.get("usage") or {}
    return ask


# -----------------------------------------------------------------------------
# Proposer: an external coding agent in the archive directory (the paper's setup)

def _command_proposer(domain, command, timeout, digest_chars):
    def propose(archive_dir, k):
        propose.errors = []
        new = os.path.join(archive_dir, "new")
        shutil.rmtree(new, ignore_errors=True)  # files of the last call are archived already
        os.makedirs(new)
        allowed = (mh.read_json(os.path.join(archive_dir, "rules.json"), {}) or {}).get("allowed_axes")
        restrict = "" if allowed is None else (
            f"\n- PROMPT-ONLY SEARCH: change ONLY the top-level definitions {allowed} of the best "
            "candidate; every other top-level definition must stay exactly as it is.")
        prompt = (
            f"# Propose {k} new harness files\n\nYou are the proposer of a Meta-Harness search. "
            "This directory is the archive of the search so far:\n"
            "- cand_NNN/harness.py: each candidate's source; cand_NNN/scores.json: its success rate, "
            "mean turns/tokens and per-example scores (in the order of example_ids); "
            "cand_NNN/traces.jsonl: every rollout (model calls, tool calls, answer, score); "
            "cand_NNN/invalid.txt: why a candidate was rejected\n"
            "- summary.jsonl (one line per candidate), iterations.jsonl, frontier.json\n"
            "Read the sources and especially the traces of failed and successful rollouts.\n\n"
            f"## Task\n{domain.SKILL}\n\n{RULES}{restrict}\n\n"
            f"## Output\nWrite exactly {k} files new/cand_1.py ... new/cand_{k}.py, each a complete "
            "harness whose module docstring starts with one line naming its mechanism. Change nothing "
            "else in this directory.\n\n"
            f"{archive_digest(archive_dir, digest_chars, n_traces=0)}\n")
        path = os.path.join(archive_dir, "PROPOSE.md")
        with open(path, "w") as f:
            f.write(prompt)
        propose.stats["calls"] += 1
        propose.stats["prompt_chars"] += len(prompt)
        t0 = time.time()
        try:
            # Own process group, so a timeout kills the agent and everything it started.
            proc = subprocess.Popen(command.replace("{prompt_file}", shlex.quote(path)), shell=True, cwd=archive_dir,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            try:
                out, _ = proc.communicate(prompt, timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                propose.errors.append(f"command: timed out after {timeout}s; collecting what it wrote")
            if proc.returncode:
                propose.errors.append(f"command: exit status {proc.returncode}: {_short((out or '')[-300:], 300)}")
            with open(os.path.join(archive_dir, "PROPOSE.log"), "w") as f:
                f.write(out or "")
        except OSError as e:
            propose.errors.append(f"command: could not start: {e}")
            out = ""
        propose.stats["seconds"] += time.time() - t0
        files = sorted((f for f in os.listdir(new) if re.fullmatch(r"cand_.*\.py", f)),
                       key=lambda f: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", f)])
        cands = []
        for fname in files[:k]:
            src = mh.read_text(os.path.join(new, fname), "")
            try:
                note = (ast.get_docstring(ast.parse(src)) or "").strip().splitlines()[0]
            except (SyntaxError, ValueError, IndexError):
                note = ""
            cands.append(dict(source=src, proposer="command", note=note or f"(new/{fname}, no docstring)"))
        propose.stats["completion_chars"] += len(out or "") + sum(len(c["source"]) for c in cands)
        if not cands:
            propose.errors.append("command: no new/cand_*.py files were written")
        return cands
    propose.stats = dict(calls=0, prompt_chars=0, completion_chars=0, seconds=0.0)
    propose.errors = []
    return propose


# -----------------------------------------------------------------------------

def endpoint_error(base_url, model=None, api_key=None, timeout=10.0):
    """None if an OpenAI-compatible endpoint answers a one-token chat request with a reply
    that has text, else why not (one line). It costs one tiny request, so a down or garbage
    endpoint is reported when the run starts, not after its first weight phase."""
    ask = _openai_ask(base_url, model, api_key, max_tokens=1, timeout=timeout)
    try:
        ask("Say OK.")
    except urllib.error.HTTPError as e:
        hint = " (give --proposer-model if it lists no models)" if model is None and e.code == 404 else ""
        return f"proposer endpoint {base_url} answered HTTP {e.code} {e.reason}{hint}"
    except (urllib.error.URLError, OSError) as e:
        return f"proposer endpoint {base_url} is not reachable: {getattr(e, 'reason', e)}"
    except (ValueError, KeyError, IndexError, TypeError) as e:  # JSONDecodeError is a ValueError
        return f"proposer endpoint {base_url} answers garbage, not an OpenAI chat completion ({type(e).__name__})"
    return None


def make_proposer(name, domain, *, llm_text=None, base_url=None, model=None, api_key=None, command=None,
                  rng_seed=0, max_tokens=3000, timeout=None, digest_chars=12000):
    """propose(archive_dir, k) -> [dict(source, proposer, note, [parent, axis, raw])].
    The callable carries .stats (calls, chars, tokens, seconds) and .errors (last call)."""
    if name == "primitives":
        return _primitives_proposer(domain, rng_seed)
    if name == "self":
        if llm_text is None:
            raise ValueError("the self proposer needs llm_text(prompt, max_tokens) -> str")

        def ask(prompt):
            out = llm_text(prompt, max_tokens)
            if isinstance(out, dict):  # an engine may also report token counts
                return str(out.get("text", "")), out
            return str(out), {}
        return _llm_proposer("self", domain, ask, digest_chars)
    if name == "openai":
        base_url = base_url or os.environ.get("WHALE_PROPOSER_URL")
        if not base_url:
            raise ValueError("the openai proposer needs base_url or WHALE_PROPOSER_URL")
        ask = _openai_ask(base_url, model or os.environ.get("WHALE_PROPOSER_MODEL"),
                          api_key or os.environ.get("OPENAI_API_KEY"), max_tokens, timeout or 300.0)
        return _llm_proposer("openai", domain, ask, digest_chars,
                             transport_errors=(urllib.error.URLError, ConnectionError, TimeoutError))
    if name == "command":
        if not command:
            raise ValueError("the command proposer needs command, e.g. 'claude -p'")
        return _command_proposer(domain, command, timeout or 1800.0, digest_chars)
    raise ValueError(f"unknown proposer {name!r}; expected primitives, self, openai or command")
