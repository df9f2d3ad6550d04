"""meta_harness.py: phase B of WHALE, a Meta-Harness search over harness source files.

One harness phase = one search = one archive directory on disk:
  iteration 0   evaluate the incoming harness as cand_000 (it is the incumbent);
  iteration i   a proposer reads the archive and writes k new harness files; each one is
                validated (parses, defines run(task, llm, tools), imports only the standard
                library, is not a repeat of an archived source, [prompt-only: differs from
                the base only in the domain's PROMPT_AXES], runs ONE task in the sandbox),
                then evaluated once per example of D_harness. Valid or not, all is archived.
  selection     the paper takes the archive argmax of (success desc, mean turns asc). We log
                that choice every iteration, but the incumbent is replaced only when a
                one-sided paired sign test on the same examples says the gain is beyond noise
                (see `accept`). The phase returns the incumbent.
  stopping      should_stop(history) after every iteration; history[i] = the archive's best
                success rate after iteration i (switch.py's harness_done takes exactly that).

Archive layout (this is everything a proposer may read: harness-split traces only, never the
reference answers, never the test split):
  cand_NNN/harness.py    the source as proposed (even if broken)
           meta.json     iteration, proposer, parent, axis, note; written at proposal time
           scores.json   success, mean turns/tokens, n, per-example scores in the FIXED example
                         order (example_ids), status counts, proposer, parent, axis, note, cost
           traces.jsonl  every rollout record of the evaluation (token id lists dropped)
           invalid.txt   why it was rejected (then there is no scores.json)
           reply.txt     the LLM proposer's raw reply, when there was one
  summary.jsonl          append-only, one line per finished candidate (with its cost)
  iterations.jsonl       append-only, one line per finished iteration: both choices, the test,
                         the incumbent, the proposer's cost
  frontier.json          Pareto frontier: success vs mean turns, success vs mean context tokens
  rules.json             what proposers must respect (the axes a prompt-only search may change)

Resuming: call search_phase again on the same archive_dir. Finished candidates (scores.json or
invalid.txt) are reused, candidates proposed but not finished are finished without asking the
proposer again, the history and incumbent come from iterations.jsonl, and the counters are the
sum of the costs recorded in summary.jsonl + iterations.jsonl (so they count finished work).

Proposers, one interface: propose(archive_dir, k) -> [dict(source, proposer, note, ...)]
  primitives  offline default: the archive's best with ONE axis (a top-level name) replaced by
              one of domain.PRIMITIVES' alternatives, spliced in by name with `ast`;
  self        the policy model writes candidates from an archive digest (llm_text callable);
  openai      the same prompt to any OpenAI-compatible /chat/completions endpoint (urllib);
  command     an external coding agent (e.g. "claude -p") run inside the archive directory.

What it leaves out: running harness code (sandbox.py, behind the evaluate/validate_run
callables the lead passes in), the model (engine.py), when to switch (switch.py), parallel
proposer calls. The proposer is trusted not to tamper with archive files: the command proposer
runs inside the archive directory, as in the paper, and could edit them.
"""

import ast
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections import Counter

# -----------------------------------------------------------------------------
# Source surgery: top-level names, splice, "differs only in"


def _defined_names(node):
    """Names a top-level statement binds: def/class names and assignment targets."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _span(node):
    """1-based inclusive line range of a statement, decorators included."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]), node.end_lineno


def top_level_names(source):
    """{name: (first_line, last_line)} for every top-level def/class/assignment, in file order.
    A name bound twice maps to its last binding, the one in effect after import."""
    out = {}
    for node in ast.parse(source).body:
        for name in _defined_names(node):
            out.pop(name, None)
            out[name] = _span(node)
    return out


def _lines(source):
    # Split on "\n" only (keeping it), the way ast counts lines; str.splitlines would also
    # split on form feeds and other separators inside strings and shift every line number.
    return re.findall(r"[^\n]*\n|[^\n]+\Z", source)


def splice(source, name, new_def_source):
    """Replace the top-level definition of `name` by `new_def_source`, which must be ONE
    statement defining exactly `name`. Every other line of `source` stays byte-identical:
    we cut by the ast node's line range instead of unparsing, which would drop comments and
    reformat the file. Raises KeyError if `name` is not defined, ValueError if it cannot be
    spliced cleanly."""
    new_def = textwrap.dedent(new_def_source).strip("\n").rstrip() + "\n"
    new_tree = ast.parse(new_def)
    if len(new_tree.body) != 1 or _defined_names(new_tree.body[0]) != [name]:
        raise ValueError(f"replacement must be one statement defining exactly {name!r}")
    tree = ast.parse(source)
    hits = [i for i, n in enumerate(tree.body) if name in _defined_names(n)]
    if not hits:
        raise KeyError(f"{name!r} is not defined at top level")
    i = hits[-1]  # the binding in effect
    node = tree.body[i]
    if _defined_names(node) != [name]:
        raise ValueError(f"{name!r} is bound together with other names; cannot splice it alone")
    start, end = _span(node)
    for j, other in enumerate(tree.body):  # "A = 1; B = 2" shares a line: refuse, don't mangle B
        if j != i and _span(other)[0] <= end and _span(other)[1] >= start:
            raise ValueError(f"{name!r} shares lines with another statement")
    lines = _lines(source)
    out = "".join(lines[:start - 1]) + new_def + "".join(lines[end:])
    # Verify by re-parsing: the same statements, one of them swapped for the new one.
    out_body = ast.parse(out).body
    want = tree.body[:i] + new_tree.body + tree.body[i + 1:]
    if [ast.dump(n) for n in out_body] != [ast.dump(n) for n in want]:
        raise ValueError(f"splice of {name!r} did not re-parse to the intended program")
    return out


def _strip_docstrings(tree):
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree


def normalized(source):
    """Canonical form for "is this the same program": the ast dump without comments, layout
    or docstrings (a reworded docstring is not a new candidate worth 128 rollouts)."""
    try:
        return ast.dump(_strip_docstrings(ast.parse(source)))
    except (SyntaxError, ValueError):
        return "unparsable:" + source.strip()


def _keyed_statements(source):
    """Top-level statements keyed by the names they bind (unnamed ones: '<stmt>', numbered),
    the module docstring left out (text, no behaviour)."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    out, seen = {}, Counter()
    for node in body:
        names = _defined_names(node)
        key = ",".join(names) or "<stmt>"
        seen[key] += 1
        out[key if seen[key] == 1 else f"{key}#{seen[key]}"] = (set(names), ast.dump(node))
    return out


def differs_only_in(base_src, cand_src, allowed_names):
    """(True, "") if `cand_src` equals `base_src` except for top-level definitions of
    `allowed_names` (compared as ASTs, so comments and layout do not count), else (False, why).
    This is FST's restriction: a prompt-only search may change the prompt texts, nothing else."""
    allowed = set(allowed_names)
    try:
        base, cand = _keyed_statements(base_src), _keyed_statements(cand_src)
    except SyntaxError as e:
        return False, f"syntax error: {e}"
    for key in sorted(set(base) | set(cand)):
        b, c = base.get(key), cand.get(key)
        names = (b or c)[0]
        if b is not None and c is not None and b[1] == c[1]:
            continue
        if names and names <= allowed:
            continue
        what = "added" if b is None else "removed" if c is None else "changed"
        return False, f"{what} top-level {key!r}, outside the allowed {sorted(allowed)}"
    return True, ""


# -----------------------------------------------------------------------------
# Archive on disk


def cand_name(i):
    return f"cand_{i:03d}"


def _read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _write_json(path, obj):
    tmp = path + ".tmp"  # write then rename: a crash never leaves half a scores.json behind
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def _read_text(path, default=None):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


def _read_jsonl(path):
    out = []
    for line in (_read_text(path, "") or "").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by a crash
    return out


def _append_jsonl(path, obj):
    with open(path, "a+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():  # after a crash mid-line, start on a fresh line so the next one parses
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":
                f.write("\n")
        f.write(json.dumps(obj, default=str) + "\n")


def load_archive(archive_dir):
    """Every candidate directory, in number order: name, num, dir, source, meta, scores
    (None until evaluated) and invalid (the reason, or None). Traces are read on demand."""
    out = []
    names = os.listdir(archive_dir) if os.path.isdir(archive_dir) else []
    for name in sorted((n for n in names if re.fullmatch(r"cand_\d{3,}", n)), key=lambda n: int(n[5:])):
        d = os.path.join(archive_dir, name)
        out.append(dict(name=name, num=int(name[5:]), dir=d,
                        source=_read_text(os.path.join(d, "harness.py"), ""),
                        meta=_read_json(os.path.join(d, "meta.json"), {}),
                        scores=_read_json(os.path.join(d, "scores.json")),
                        invalid=_read_text(os.path.join(d, "invalid.txt"))))
    return out


def read_traces(cand):
    return _read_jsonl(os.path.join(cand["dir"], "traces.jsonl"))


def rank_key(cand):
    """The paper's order: success desc, then mean turns asc; ties go to the older candidate."""
    s = cand["scores"]
    return (-s["success"], s["mean_turns"], cand["num"])


def paper_best(archive):
    scored = [c for c in archive if c["scores"]]
    return min(scored, key=rank_key) if scored else None


def score_records(records, example_ids):
    """Rollout records -> scores. per_example follows example_ids (the fixed order the paired
    test needs); an example with several rollouts gets their mean, one with none scores 0."""
    by_id = {eid: [] for eid in example_ids}
    for r in records:
        if str(r.get("example_id")) in by_id:
            by_id[str(r.get("example_id"))].append(float(r.get("score") or 0.0))
    per_example = [sum(v) / len(v) if v else 0.0 for v in by_id.values()]

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0
    return dict(success=mean(per_example),
                mean_turns=mean([float(r["turns"] if r.get("turns") is not None else len(r.get("calls") or []))
                                 for r in records]),
                mean_tokens=mean([float(r.get("tokens") or 0) for r in records]),
                n=len(example_ids), rollouts=len(records),
                missing=sum(not v for v in by_id.values()),
                status_counts=dict(Counter(str(r.get("status")) for r in records)),
                example_ids=list(example_ids), per_example=per_example)


def pareto(points, cost):
    """Candidates not dominated on (higher success, lower `cost`), by success desc."""
    front = [p for p in points if not any(
        q["success"] >= p["success"] and q[cost] <= p[cost] and
        (q["success"] > p["success"] or q[cost] < p[cost]) for q in points)]
    return sorted(front, key=lambda p: (-p["success"], p[cost]))


def _write_frontier(archive_dir):
    pts = [dict(cand=c["name"], success=c["scores"]["success"], mean_turns=c["scores"]["mean_turns"],
                mean_tokens=c["scores"]["mean_tokens"]) for c in load_archive(archive_dir) if c["scores"]]
    _write_json(os.path.join(archive_dir, "frontier.json"),
                dict(success_vs_turns=pareto(pts, "mean_turns"), success_vs_tokens=pareto(pts, "mean_tokens")))


def _drop_token_ids(obj):
    # Token id lists are for phase A's training, useless to a proposer, and most of the bytes.
    if isinstance(obj, dict):
        return {k: _drop_token_ids(v) for k, v in obj.items() if k not in ("prompt_ids", "completion_ids")}
    if isinstance(obj, list):
        return [_drop_token_ids(v) for v in obj]
    return obj


# -----------------------------------------------------------------------------
# Acceptance: a paired test on the same examples


def sign_test(cand_scores, inc_scores):
    """Exact one-sided sign test (McNemar's exact test) on paired per-example scores.
    b = examples the candidate does better on, c = the incumbent does better on; ties carry no
    information. Under "no difference" each discordant pair is a fair coin, so
    p = P(Binom(b + c, 1/2) >= b)."""
    pairs = [(float(x), float(y)) for x, y in zip(cand_scores, inc_scores)]  # plain floats, not numpy
    b = sum(x > y for x, y in pairs)
    c = sum(x < y for x, y in pairs)
    n = b + c
    p = sum(math.comb(n, j) for j in range(b, n + 1)) / 2 ** n if n else 1.0
    return b, c, p


def accept(cand_scores, inc_scores, alpha=0.1):
    """(accepted, b, c, p). Why not the paper's plain argmax: every candidate is scored with
    one or two rollouts per example, so with 3 candidates per iteration the argmax is often a lucky
    draw of a harness no better than the incumbent. The candidate must win the discordant
    pairs and the exact test must reject "no better" at level alpha. Pairing on the same
    examples removes the example-difficulty variance an unpaired comparison would carry.
    Only the single best candidate is tested per iteration, but it is the max of several, so
    an equal candidate gets in somewhat more often than alpha; that costs nothing in
    expectation, while a worse one stays out."""
    b, c, p = sign_test(cand_scores, inc_scores)
    return (b > c and p <= alpha), b, c, p


# -----------------------------------------------------------------------------
# Validation


def static_check(source):
    """Reason the source cannot be a harness, or None: parses, defines run(task, llm, tools)
    at top level, imports only the standard library (the sandbox enforces more at run time)."""
    if not isinstance(source, str) or not source.strip():
        return "empty source (the proposer returned no code)"
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"syntax error: {e.msg} (line {e.lineno})"
    except ValueError as e:  # null bytes
        return f"unparsable: {e}"
    runs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    if not runs:
        return "no top-level function run(task, llm, tools)"
    a = runs[-1].args
    if len(a.posonlyargs) + len(a.args) < 3 and a.vararg is None:
        return "run must accept (task, llm, tools)"
    for node in ast.walk(tree):
        mods = [x.name for x in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        for m in mods:
            top = m.split(".")[0]
            if top not in sys.stdlib_module_names and top != "__future__":
                return f"imports {m!r}, not in the standard library"
    return None


# -----------------------------------------------------------------------------
# The search


def _sum_costs(archive_dir):
    total = Counter()
    for name in ("summary.jsonl", "iterations.jsonl"):
        for line in _read_jsonl(os.path.join(archive_dir, name)):
            total.update(line.get("cost") or {})
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in total.items()}


def _write_candidate(archive_dir, num, cand, iteration, proposal_cost):
    d = os.path.join(archive_dir, cand_name(num))
    os.makedirs(d, exist_ok=True)
    src = cand.get("source")
    with open(os.path.join(d, "harness.py"), "w") as f:
        f.write(src if isinstance(src, str) else "")
    if cand.get("raw"):
        with open(os.path.join(d, "reply.txt"), "w") as f:
            f.write(str(cand["raw"]))
    # The proposer's cost travels with the iteration's candidates so a resumed run can still
    # book it when it finishes the iteration.
    _write_json(os.path.join(d, "meta.json"), dict(
        iteration=iteration, proposer=str(cand.get("proposer", "?")), parent=cand.get("parent"),
        axis=cand.get("axis"), note=str(cand.get("note", ""))[:2000], proposal_cost=proposal_cost))


def _summary_line(c):
    m, s = c["meta"], c["scores"]
    line = dict(cand=c["name"], iteration=m.get("iteration"), proposer=m.get("proposer"),
                parent=m.get("parent"), axis=m.get("axis"), note=m.get("note"))
    if s:
        line.update(status="ok", success=s["success"], mean_turns=s["mean_turns"],
                    mean_tokens=s["mean_tokens"], n=s["n"], status_counts=s["status_counts"],
                    cost=s.get("cost", {}))
    else:
        line.update(status="invalid", reason=(c["invalid"] or "").strip(),
                    cost=dict(candidates=1, invalid=1))
    return line


def _finish_candidate(c, archive_dir, archive, examples, ids, evaluate, validate_run,
                      prompt_only_base, allowed, log):
    """Validate, then evaluate (or reject) one proposed candidate; write its files."""
    src, d, t0 = c["source"], c["dir"], time.time()
    reason = None
    if c["num"] > 0:  # the incoming harness is evaluated whatever it is: it is the incumbent
        reason = static_check(src)
        if reason is None:
            norm = normalized(src)
            dup = [o["name"] for o in archive if o["num"] < c["num"] and normalized(o["source"]) == norm]
            reason = f"duplicate of {dup[0]}" if dup else None
        if reason is None and prompt_only_base is not None:
            ok, why = differs_only_in(prompt_only_base, src, allowed)
            reason = None if ok else f"prompt-only search: {why}"
        if reason is None:
            try:
                reason = validate_run(src)
            except Exception as e:  # a validator failure rejects the candidate, not the run
                reason = f"validate_run raised {type(e).__name__}: {e}"
    if reason is not None:
        with open(os.path.join(d, "invalid.txt"), "w") as f:
            f.write(str(reason).strip() + "\n")
        c["invalid"] = str(reason)
        _append_jsonl(os.path.join(archive_dir, "summary.jsonl"), _summary_line(c))
        log(dict(event="harness_candidate", cand=c["name"], status="invalid", reason=str(reason)[:300]))
        return
    t1 = time.time()
    # Exceptions from evaluate propagate: they mean the infrastructure broke (a broken harness
    # comes back as records with status error/crash/timeout). The archive stays resumable.
    records = evaluate(src, examples, c["name"])
    t2 = time.time()
    with open(os.path.join(d, "traces.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(_drop_token_ids(r), default=str) + "\n")
    s = score_records(records, ids)
    m = c["meta"]
    s.update(cand=c["name"], iteration=m.get("iteration"), proposer=m.get("proposer"),
             parent=m.get("parent"), axis=m.get("axis"), note=m.get("note"),
             cost=dict(candidates=1, evaluated=1, rollouts=len(records),
                       rollout_tokens=sum(int(r.get("tokens") or 0) for r in records),
                       validate_seconds=round(t1 - t0, 3), eval_seconds=round(t2 - t1, 3)))
    _write_json(os.path.join(d, "scores.json"), s)
    c["scores"] = s
    _append_jsonl(os.path.join(archive_dir, "summary.jsonl"), _summary_line(c))
    _write_frontier(archive_dir)
    log(dict(event="harness_candidate", cand=c["name"], status="ok", success=round(s["success"], 4),
             mean_turns=round(s["mean_turns"], 3), proposer=m.get("proposer"), axis=m.get("axis")))


def _propose(propose, archive_dir, k, log):
    """Ask the proposer; never let it crash the run. Returns (candidates, cost, errors)."""
    stats0 = dict(getattr(propose, "stats", {}) or {})
    t0 = time.time()
    try:
        cands = list(propose(archive_dir, k) or [])[:k]
        errors = list(getattr(propose, "errors", []) or [])
    except Exception as e:
        cands, errors = [], [f"proposer raised {type(e).__name__}: {e}"]
    stats = dict(getattr(propose, "stats", {}) or {})
    cost = {f"proposer_{key}": stats.get(key, 0) - stats0.get(key, 0)
            for key in ("calls", "prompt_chars", "completion_chars", "prompt_tokens", "completion_tokens")}
    cost["proposer_calls"] = cost["proposer_calls"] or 1  # a plain callable counts as one call
    cost["proposer_seconds"] = round(time.time() - t0, 3)
    cands = [c if isinstance(c, dict) else {"source": c if isinstance(c, str) else ""} for c in cands]
    for e in errors:
        log(dict(event="proposer_error", reason=str(e)[:500]))
    return cands, cost, errors


def search_phase(incumbent_src, domain, examples, evaluate, validate_run, propose, *, archive_dir,
                 k=3, should_stop, prompt_only_base=None, accept_alpha=0.1, log=print):
    """Run (or resume) one Meta-Harness search. Returns dict(best_source, best_scores,
    iterations, counters, history, incumbent, paper_choice).

    evaluate(source, examples, phase_tag) -> rollout records (phase_tag = the candidate name;
    seeding by example rather than by tag gives every candidate the same random numbers,
    which makes the paired test sharper). validate_run(source) -> reason or None.
    should_stop(history) is asked after every iteration, iteration 0 included."""
    os.makedirs(archive_dir, exist_ok=True)
    ids = [str(ex["id"]) for ex in examples]
    allowed = sorted(domain.PROMPT_AXES) if prompt_only_base is not None else None
    # Proposers read the restriction from the archive, so the flag is not threaded through them.
    _write_json(os.path.join(archive_dir, "rules.json"), dict(allowed_axes=allowed, k=k))
    summary_path = os.path.join(archive_dir, "summary.jsonl")
    iters_path = os.path.join(archive_dir, "iterations.jsonl")

    archive = load_archive(archive_dir)
    first = next((c for c in archive if c["num"] == 0), None)
    if first is not None and normalized(first["source"]) != normalized(incumbent_src):
        raise ValueError(f"{archive_dir} holds a different cand_000; use a fresh archive_dir per phase")
    if first is None or "iteration" not in first["meta"]:
        _write_candidate(archive_dir, 0, dict(source=incumbent_src, proposer="incoming",
                                              note="the incoming harness h0 of this phase"), 0, None)
    for c in archive:  # a resumed archive must be about the same examples, in the same order
        if c["scores"] and c["scores"].get("example_ids") != ids:
            raise ValueError(f"{c['name']} was scored on other examples than these")
    # Crash between scores.json and its summary line: add the missing lines (append-only).
    done = {line.get("cand") for line in _read_jsonl(summary_path)}
    for c in archive:
        if (c["scores"] or c["invalid"]) and c["name"] not in done:
            _append_jsonl(summary_path, _summary_line(c))

    while True:
        iters = _read_jsonl(iters_path)
        history = [line["archive_best"] for line in iters]
        if iters and should_stop(list(history)):
            break
        it = len(iters)
        incumbent = iters[-1]["incumbent"] if iters else cand_name(0)
        archive = load_archive(archive_dir)
        members = [c for c in archive if c["meta"].get("iteration") == it]
        errors = []
        if members:  # proposed before a crash (or cand_000): finish them, don't ask again
            cost = next((c["meta"]["proposal_cost"] for c in members if c["meta"].get("proposal_cost")), {})
        else:
            cands, cost, errors = _propose(propose, archive_dir, k, log)
            nxt = max([c["num"] for c in archive] + [0]) + 1
            for j, cand in enumerate(cands):
                _write_candidate(archive_dir, nxt + j, cand, it, cost)
            archive = load_archive(archive_dir)
            members = [c for c in archive if c["meta"].get("iteration") == it]
        for c in members:
            if not (c["scores"] or c["invalid"]):
                _finish_candidate(c, archive_dir, archive, examples, ids, evaluate, validate_run,
                                  prompt_only_base, allowed, log)

        # Selection: the paper's argmax over the whole phase archive, and ours.
        scored = [c for c in archive if c["scores"]]
        by_name = {c["name"]: c for c in scored}
        paper = paper_best(scored)
        inc = by_name[incumbent]
        test, accepted = None, False
        if paper["name"] != incumbent:
            accepted, b, c_, p = accept(paper["scores"]["per_example"], inc["scores"]["per_example"],
                                        accept_alpha)
            test = dict(cand=paper["name"], vs=incumbent, b=b, c=c_, p=round(p, 6), alpha=accept_alpha)
        new_inc = paper["name"] if accepted else incumbent
        it_scores = [c["scores"]["success"] for c in members if c["scores"]]
        line = dict(iteration=it, cands=[c["name"] for c in members],
                    iteration_best=max(it_scores) if it_scores else None,
                    archive_best=paper["scores"]["success"],
                    paper_choice=paper["name"], paper_success=paper["scores"]["success"],
                    paper_mean_turns=paper["scores"]["mean_turns"],
                    test=test, accepted=accepted, incumbent=new_inc,
                    incumbent_success=by_name[new_inc]["scores"]["success"],
                    proposer_errors=[str(e)[:300] for e in errors],
                    cost=dict(cost, iterations=1, accepted=int(accepted)))
        _append_jsonl(iters_path, line)
        log(dict(event="harness_iteration", **{k_: v for k_, v in line.items() if k_ != "cost"}))

    archive = load_archive(archive_dir)
    by_name = {c["name"]: c for c in archive}
    inc = by_name[iters[-1]["incumbent"]]
    return dict(best_source=inc["source"], best_scores=inc["scores"], iterations=len(iters),
                counters=_sum_costs(archive_dir), history=history, incumbent=inc["name"],
                paper_choice=iters[-1]["paper_choice"])


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
    # answered, but the answer is nowhere in the tool output: retrieval / tool use missed it
    "unsupported": ("search", "query", "retriev", "rewrite", "top", "k", "passage", "chars",
                    "context", "code", "python", "observation", "feedback"),
    # the answer came from the tool output and was still wrong: instructions / format
    "wrong": ("system", "prompt", "template", "user", "instruction", "format", "extract", "answer"),
}


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
        elif _norm_text(answer) not in " ".join(_norm_text(t.get("result", "")) for t in tools):
            sig["unsupported"] += 1
        else:
            sig["wrong"] += 1
    return sig


def axis_matches(axis, signature):
    words = axis.lower().split("_")
    return any(kw in words or (len(kw) > 3 and kw in axis.lower()) for kw in SIGNATURE_KEYWORDS[signature])


def rank_axes(axes, signatures, tried, rng):
    """Axes by how many failures point at them, divided by 1 + how often they were already
    tried (so a favourite does not starve the rest); then untried before tried; then a
    seeded coin. With no failure signal this is "untried axes first, in random order"."""
    def key(a):
        weight = sum(n for s, n in signatures.items() if axis_matches(a, s))
        return (-weight / (1 + tried[a]), tried[a], rng.random())
    return sorted(axes, key=key)


def _primitives_proposer(domain, rng_seed):
    def propose(archive_dir, k):
        propose.errors = []
        archive = load_archive(archive_dir)
        parent = paper_best(archive)
        if parent is None:
            propose.errors.append("primitives: no evaluated candidate to start from")
            return []
        allowed = (_read_json(os.path.join(archive_dir, "rules.json"), {}) or {}).get("allowed_axes")
        spans = top_level_names(parent["source"])
        axes = [a for a in domain.PRIMITIVES if a in spans and (allowed is None or a in allowed)]
        signatures = failure_signatures(read_traces(parent))
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
                    propose.errors.append(f"primitives: {axis} alternative {j}: {e}")
                    continue
                queues[axis].append((j, src))
        # One candidate per axis first (k different mechanisms), then second choices, ...
        out = []
        while len(out) < k and any(queues.values()):
            for axis, q in queues.items():
                while q and len(out) < k:
                    j, src = q.pop(0)
                    if normalized(src) in seen:  # never repeat an archived source
                        continue
                    seen.add(normalized(src))
                    hint = ", ".join(f"{s} x{n}" for s, n in signatures.most_common()) or "none"
                    out.append(dict(source=src, proposer="primitives", parent=parent["name"], axis=axis,
                                    note=f"{axis}: alternative {j + 1}/{len(domain.PRIMITIVES[axis])} "
                                         f"on {parent['name']} (failures of the parent: {hint})"))
                    break
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
    archive = load_archive(archive_dir)
    scored = sorted((c for c in archive if c["scores"]), key=rank_key)
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
    recs = read_traces(best)
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
    rules = (_read_json(os.path.join(archive_dir, "rules.json"), {}) or {})
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
        best = paper_best(load_archive(archive_dir))
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
        allowed = (_read_json(os.path.join(archive_dir, "rules.json"), {}) or {}).get("allowed_axes")
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
            src = _read_text(os.path.join(new, fname), "")
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
