"""
primitives.py: the offline proposer of phase B (the default: no LLM, no network, deterministic).

The search space is the domain's PRIMITIVES: for each axis (a top-level name of the harness:
SYSTEM_PROMPT, RETRIEVAL, extract_answer, ...) a list of alternative definitions, written from
harness-split traces. A proposal, in this order:
  swap      the paper's choice (the archive's top scorer, harness_archive.paper_choice: the parent;
            on a tie, optionally the newest of the tied: parent_of) with ONE axis replaced by one
            of its alternatives, spliced in by name with `ast`;
            axes ranked by the failure signatures of the parent's failed traces (which axis the
            failures point at), so the first draws go where the traces say the harness fails;
  merge     first, when k >= 2 and there is one: the parent + what one or two other lineages changed
            against their own parents where that held or helped (gain >= 0), on axes the parent has
            not changed (`merges`): how several changes that each score ~0 alone come together;
  combine   when single swaps on the parent are used up: the axes that helped in other top
            candidates (their changes against their own parents), grafted onto the parent;
  retry     near misses (within two examples of the parent) one swap further;
  pair      two alternatives of different axes at once on the parent.
Every candidate says how it was made (kind, axes, parents: meta_harness keeps it in meta.json),
and its docstring's first line says it too (its hypothesis in summary.jsonl and the report).
The same archive gives the same proposals (seeded by its size), so a resumed search proposes
what the crashed one would have; once nothing new is left, its Proposal says exhausted and the phase ends.

failure_signatures is also what the LLM and agent proposers show of failed traces. What it
leaves out: learning which axes help across runs (every search starts from the menu's order).
"""
import os
import random
import re
from collections import Counter

from harness_search import harness_archive
from harness_search.harness_source import normalized, splice, top_level_names, with_hypothesis
from harness_search.proposal import Proposal  # what every proposer returns

TOP_DONORS = 8  # how many top candidates may give an axis to a combination


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
    # the answer came from the tool output and was still wrong: instructions / format, how the options
    # are shown (chess's annotate_moves), or the loop that makes the answer (`run`: searchqa's repair
    # against the evidence, or a vote over replies)
    "wrong": ("system", "prompt", "template", "user", "instruction", "format", "annotate", "extract", "answer",
              "run"),
}


# a line that ends in "..." or "...[output truncated]": how searchqa and math mark a cut tool output
CUT_MARK = re.compile(r"\.\.\.(\[[^\]\n]*\])?[ \t]*$", re.M)


def _norm_text(x):
    return re.sub(r"\s+", " ", str(x)).strip().lower()


def failure_signatures(records, domain=None):
    """Counter of signatures over the failed rollouts (score < 0.5) of one candidate. A domain
    that defines failure_signature(record) names its failures itself (None: the rules below,
    which read tool calls and so call every failure of a tool-less domain "no_tool")."""
    sig = Counter()
    own = getattr(domain, "failure_signature", None)
    for r in records:
        if float(r.get("score") or 0) >= 0.5:
            continue
        named = own(r) if own else None
        if named is not None:
            if named not in SIGNATURE_KEYWORDS:
                raise ValueError(f"{domain.__name__}.failure_signature returned {named!r}, not one of "
                                 f"{', '.join(SIGNATURE_KEYWORDS)}")
            sig[named] += 1
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


def definition(source, name):
    """The source lines of the top-level definition of `name` (what splice puts in)."""
    start, end = top_level_names(source)[name]
    return "\n".join(source.split("\n")[start - 1:end]) + "\n"


def changed_axes(parent_src, src, axes):
    """The axes whose definitions differ between two sources (compared as ASTs, so comments,
    layout and docstrings do not count)."""
    try:
        a, b = top_level_names(parent_src), top_level_names(src)
    except (SyntaxError, ValueError):
        return []
    return [x for x in axes if x in a and x in b
            and normalized(definition(parent_src, x)) != normalized(definition(src, x))]


def grafts_that_helped(best, scored, axes, seed_source, top=TOP_DONORS):
    """(gain, axis, definition, donor) for every axis a top candidate changed against its own
    parent without losing to it (gain >= 0), on the axes the best still has at their seed value
    (an axis the best already changed is its own choice, made on a larger gain or none): what
    worked elsewhere and the best does not have yet. Largest gain first."""
    by_name = {c["name"]: c for c in scored}
    open_axes = set(axes) - set(changed_axes(seed_source, best["source"], axes))
    out, keys = [], set()
    for donor in sorted(scored, key=harness_archive.rank_key)[:top]:
        parent = by_name.get(donor["meta"].get("parent"))
        if parent is None or donor["name"] == best["name"]:
            continue
        gain = donor["scores"]["success"] - parent["scores"]["success"]
        if gain < 0:
            continue
        for axis in changed_axes(parent["source"], donor["source"], axes):
            d = definition(donor["source"], axis)
            key = (axis, normalized(d))
            if axis in open_axes and key not in keys:
                keys.add(key)
                out.append((gain, axis, d, donor["name"]))
    return sorted(out, key=lambda g: -g[0])  # stable: ties keep the donors' rank order


def merges(best, scored, axes, seed_source):
    """Merges of lineages: the best + everything another candidate changed against its own parent,
    for candidates that held or helped there (grafts_that_helped: gain >= 0, axes the best has at
    their seed value), two such candidates at once when their axes differ, then one. Pairs first,
    largest summed gain first: on a plateau where single swaps all score the same (chess at 135M),
    stacking the swaps that did not hurt is the way across, and on a slope it joins what two
    lineages found. Yields ([(axis, definition), ...], parents, how)."""
    by_donor = {}
    for gain, axis, d, donor in grafts_that_helped(best, scored, axes, seed_source):
        by_donor.setdefault(donor, [gain, []])[1].append((axis, d))
    donors = list(by_donor.items())  # in the donors' rank order
    pairs = [(a, b) for i, a in enumerate(donors) for b in donors[i + 1:]
             if not {x for x, _ in a[1][1]} & {x for x, _ in b[1][1]}]
    for (a, (ga, ca)), (b, (gb, cb)) in sorted(pairs, key=lambda p: -(p[0][1][0] + p[1][1][0])):
        yield ca + cb, [best["name"], a, b], f"{a} ({ga:+.3f} on its parent) and {b} ({gb:+.3f})"
    for a, (ga, ca) in donors:
        yield ca, [best["name"], a], f"{a} ({ga:+.3f} on its parent)"


def near_misses(best, scored, margin):
    """Candidates within `margin` of the best that behave differently from it (some example
    scored differently: a clone of the best would only repeat its swaps), best first."""
    b = best["scores"]
    return [c for c in sorted(scored, key=harness_archive.rank_key) if c["name"] != best["name"]
            and c["scores"]["success"] >= b["success"] - margin
            and c["scores"].get("per_example") != b.get("per_example")]


def _splice_all(source, changes):
    for axis, d in changes:
        source = splice(source, axis, d)
    return source


def later_candidates(domain, best, scored, order, margin, seed_source):
    """What comes after the single swaps on the best run out, lazily and in this order:
      combine  the best + definitions that helped in other top candidates, on axes the best has
               not changed: one of each axis at once, then one graft, then two from different
               axes, largest gains first (a candidate = axes from several parents);
      retry    near misses (within `margin` of the best, behaving differently) as parents of
               single swaps: a path that ended just short of the best may pass it one step on;
      pair     two of the domain's alternatives at once on the best, axes in rank order.
    Yields (kind, [(axis, definition), ...], parents, base source, how); the caller splices
    and drops anything already archived, so a spliced duplicate costs nothing."""
    grafts = grafts_that_helped(best, scored, order, seed_source)
    first_per_axis = {}
    for g in grafts:  # the largest gain per axis
        first_per_axis.setdefault(g[1], g)
    if len(first_per_axis) > 2:
        every = list(first_per_axis.values())
        yield ("combine", [(g[1], g[2]) for g in every], [best["name"]] + [g[3] for g in every],
               best["source"], "every axis that helped, at once")
    for g in grafts:
        yield "combine", [(g[1], g[2])], [best["name"], g[3]], best["source"], f"gain {g[0]:+.3f} in {g[3]}"
    pairs = [(g, h) for i, g in enumerate(grafts) for h in grafts[i + 1:] if g[1] != h[1]]
    for g, h in sorted(pairs, key=lambda gh: -(gh[0][0] + gh[1][0])):
        yield ("combine", [(g[1], g[2]), (h[1], h[2])], [best["name"], g[3], h[3]], best["source"],
               f"gains {g[0]:+.3f} in {g[3]}, {h[0]:+.3f} in {h[3]}")
    for miss in near_misses(best, scored, margin):
        for axis in order:
            for j, alt in enumerate(domain.PRIMITIVES[axis]):
                yield ("retry", [(axis, alt)], [miss["name"]], miss["source"],
                       f"near miss {miss['name']} ({miss['scores']['success']:.3f} vs best "
                       f"{best['scores']['success']:.3f}), alternative {j + 1}")
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            for j, alt_a in enumerate(domain.PRIMITIVES[a]):
                for m, alt_b in enumerate(domain.PRIMITIVES[b]):
                    yield ("pair", [(a, alt_a), (b, alt_b)], [best["name"]], best["source"],
                           f"alternatives {j + 1} and {m + 1}")


def parent_of(archive, ties="older"):
    """The candidate the next swaps edit: the paper's choice (the archive's top scorer); on a tie
    for the top success, ties="older" keeps the paper's order (fewer turns, then the older), and
    ties="newer" takes the newest of the tied: a sideways move, the textbook way for a local search
    to cross a plateau. Where every candidate scores 0 (chess under a 135M model), the older rule
    keeps editing h0 and never stacks two swaps; sideways, a swap that did not hurt stays, and the
    next one goes on top of it. A candidate racing dropped ties when it scored what the best scored on
    the examples it was scored on: on a plateau at 0 racing drops every candidate at its first look,
    and without this the walk never leaves the best (chess gate 3: 47 candidates, all on h0).
    What it leaves out: a cap on sideways moves in a row (the search's budget is the cap), and any
    other sign of progress on a tie (how many rollouts answered)."""
    if ties not in ("older", "newer"):
        raise ValueError(f"unknown ties rule {ties!r}; expected older or newer")
    best = harness_archive.paper_choice(archive)
    if ties == "older" or best is None:
        return best
    on = dict(zip(best["scores"].get("example_ids") or [], best["scores"].get("per_example") or []))

    def tied(c):
        s = c["scores"]
        if not s.get("dropped_after"):
            return s["success"] == best["scores"]["success"]
        mine = [on.get(e) for e in s.get("example_ids") or []]  # the best on the raced candidate's examples
        return bool(mine) and None not in mine and abs(sum(mine) / len(mine) - s["success"]) < 1e-9
    return max((c for c in archive if c["scores"] and tied(c)), key=lambda c: c["num"])


def proposer(domain, rng_seed=0, ties="older", merge=True):
    """propose(archive_dir, k) -> Proposal of up to k candidates (proposers.py's interface), exhausted
    once nothing is left to propose on this archive. ties: which of the top-scoring candidates is
    the parent (parent_of); merge: a merge of lineages first in each proposal (`merges`)."""
    parent_of([], ties)  # an unknown rule fails here, not at the first proposal

    def propose(archive_dir, k):
        errors, spent = [], dict(calls=1)
        archive = harness_archive.load_archive(archive_dir)
        parent = parent_of(archive, ties)
        if parent is None:
            errors.append("primitives: no evaluated candidate to start from")
            return Proposal([], errors, False, spent)
        allowed = (harness_archive.read_json(os.path.join(archive_dir, "rules.json"), {}) or {}).get("allowed_axes")
        spans = top_level_names(parent["source"])
        axes = [a for a in domain.PRIMITIVES if a in spans and (allowed is None or a in allowed)]
        signatures = failure_signatures(harness_archive.read_traces(parent), domain)
        tried = Counter(c["meta"].get("axis") for c in archive)
        # Seeded by the archive size: the same archive gives the same proposals, so a resumed
        # search proposes what the crashed one would have.
        rng = random.Random(f"{rng_seed}:{len(archive)}")
        seen = {normalized(c["source"]) for c in archive}
        queues = {}
        for axis in rank_axes(axes, signatures, tried, rng):
            alts = list(enumerate(domain.PRIMITIVES[axis]))
            rng.shuffle(alts)
            queues[axis] = []
            for j, alt in alts:
                try:
                    src = splice(parent["source"], axis, alt)
                except (ValueError, KeyError, SyntaxError) as e:
                    errors.append(f"primitives: {axis} alternative {j}: {e}")
                    continue
                queues[axis].append((j, src))
        # One candidate per axis first (k different mechanisms), then second choices, ...; but
        # when one axis explains most failures of the parent (over half of them), every one of
        # its alternatives on this parent comes before the other axes': one or two draws of a
        # clearly implicated axis are a poor test of it (two draws of five alternatives can miss
        # the one that works)
        out, order = [], list(queues)
        rank = list(order)
        # A merge first, when there is one and room for single swaps beside it (k >= 2): the best with
        # the changes of one or two other lineages that held or helped (`merges`)
        scored = harness_archive.scored_whole(archive)
        seed = next((c["source"] for c in archive if c["num"] == 0), parent["source"])
        for changes, parents, how in merges(parent, scored, rank, seed) if merge and k >= 2 else ():
            try:
                src = _splice_all(parent["source"], changes)
            except (ValueError, KeyError, SyntaxError):
                continue
            if normalized(src) in seen:
                continue
            seen.add(normalized(src))
            names = [a for a, _ in changes]
            note = f"merge: {' + '.join(names)} from {', '.join(parents[1:])} on {parents[0]} ({how})"
            out.append(dict(source=with_hypothesis(src, note), proposer="primitives", parent=parents[0],
                            axis="+".join(names), kind="merge", axes=names, parents=parents, note=note))
            break
        top = order[0] if order else None
        if top and 2 * axis_weight(top, signatures) > sum(signatures.values()):
            order = [top] * len(queues[top]) + order
        hint = ", ".join(f"{s} x{n}" for s, n in signatures.most_common()) or "none"
        while len(out) < k and any(queues.values()):
            for axis in order:
                q = queues[axis]
                while q and len(out) < k:
                    j, src = q.pop(0)
                    if normalized(src) in seen:  # never repeat an archived source
                        continue
                    seen.add(normalized(src))
                    note = (f"{axis}: alternative {j + 1}/{len(domain.PRIMITIVES[axis])} "
                            f"on {parent['name']} (failures of the parent: {hint})")
                    out.append(dict(source=with_hypothesis(src, note), proposer="primitives", parent=parent["name"],
                                    axis=axis, kind="swap", axes=[axis], parents=[parent["name"]], note=note))
                    break
            order = list(queues)  # later rounds: one more per axis, in rank order
        # The single swaps on the best are used up: combine, retry near misses, pair (a
        # menu that runs dry would end a harness-only run with budget left).
        if len(out) < k:
            margin = 2.0 / max(1, parent["scores"].get("n") or 1)  # two examples' worth
            for kind, changes, parents, base, how in later_candidates(domain, parent, scored, rank, margin, seed):
                try:
                    src = _splice_all(base, changes)
                except (ValueError, KeyError, SyntaxError):
                    continue  # an axis the base does not define: not a candidate
                if normalized(src) in seen:
                    continue
                seen.add(normalized(src))
                names = [a for a, _ in changes]
                note = (f"{kind}: {' + '.join(names)} on {parents[0]}"
                        f"{' from ' + ', '.join(parents[1:]) if parents[1:] else ''} ({how})")
                out.append(dict(source=with_hypothesis(src, note), proposer="primitives", parent=parents[0],
                                axis="+".join(names), kind=kind, axes=names, parents=parents, note=note))
                if len(out) >= k:
                    break
        if not out:
            errors.append("primitives: every alternative of every allowed axis is in the archive, "
                                  "alone, combined and on the near misses")
        # The search ends at once on an exhausted menu: the same archive gives the same nothing.
        return Proposal(out, errors, not out, spent)
    return propose
