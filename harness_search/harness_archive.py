"""
harness_archive.py: phase B's archive on disk, and the reads every proposer and report shares.

Archive layout (this is everything a proposer may read: harness-split traces only, never the
reference answers, never the test split):
  cand_NNN/harness.py    the source as proposed (even if broken)
           meta.json     iteration, proposer, parent, axis, note, format (file | edit), finish
                         (why the LLM stopped), reject (a reason the proposer already knew,
                         e.g. a reply cut at the length limit), and for primitives its
                         provenance: kind, axes, parents; written at proposal time
           scores.json   success, mean turns/tokens, n, per-example scores in the FIXED example
                         order (example_ids), status counts, proposer, parent, axis, note, cost
           traces.jsonl  every rollout record of the evaluation (token id lists dropped)
           invalid.txt   why it was rejected (then there is no scores.json)
           reply.txt     the LLM proposer's raw reply, when there was one
  summary.jsonl          append-only, one line per finished candidate (with its cost and its
                         hypothesis: the first line of its module docstring)
  iterations.jsonl       append-only, one line per finished iteration: both choices, the test
                         (and its second look on the confirmation block), the incumbent, how
                         many candidates were valid, the proposer's errors and cost, and
                         stop_reason on the line that ended the phase
  frontier.json          Pareto frontier: success vs mean turns, success vs mean context tokens
  rules.json             what proposers must respect (the axes a prompt-only search may change)
  proposer_calls.jsonl   the command proposer's record of each agent call (agent_proposer.py)
Beside it, <archive_dir>.ledger.jsonl: the parent's own record, appended before the archive's
files are written: every score it measured (the confirmation block's too), every incumbent it
chose. Selection reads only the ledger; a scores.json or an incumbent in iterations.jsonl that
differs from it (an edit at any time, also between proposer calls) is refused, put back and
listed in the iteration's `integrity` field and an archive_integrity event. (The agent never
gets the ledger: it works in a copy of the archive, jailed away from the run directory; see
agent_proposer.py and agent_jail.py.)

Here: reading and writing those files (a crash never leaves half a JSON file; a line cut by a
crash is skipped), the ledger, scores from rollout records, the paper's choice (rank_key:
success desc, mean turns asc), the Pareto frontier, and a finished run packed as one run.zip
(results/ keeps those) and unpacked again. The search itself is meta_harness.py.
"""
import json
import os
import re
from collections import Counter

from harness_search.harness_source import hypothesis, normalized
from jail import received  # a run directory or run.zip from elsewhere: links, sizes, zip bombs
from jail.sandbox import valid_text  # the one text rule (lone surrogates), at every boundary


def cand_name(i):
    return f"cand_{i:03d}"


def read_json(path, default=None):
    try:
        with open(path) as f:
            return _valid_strings(json.load(f))
    except (OSError, ValueError):
        return default


def _valid_strings(obj):
    """obj as json.loads gave it, with lone surrogates in its strings replaced (valid_text). An
    archive written before every boundary checked its text may hold "\\ud800" escapes, which
    json.loads turns back into surrogates; a resumed search must not hand them on to a prompt,
    a tokenizer or a file."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")  # the common case: nothing to do
        return obj
    except UnicodeEncodeError:
        return json.loads(valid_text(json.dumps(obj, ensure_ascii=False), replace=True))


def write_json(path, obj):
    tmp = path + ".tmp"  # write then rename: a crash never leaves half a scores.json behind
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def read_text(path, default=None):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:  # (a byte that is not UTF-8: U+FFFD)
            return f.read()
    except OSError:
        return default


def read_jsonl(path):
    out = []
    for line in (read_text(path, "") or "").splitlines():
        try:
            # (json.dumps writes a surrogate as a backslash-u escape: a line without one holds none)
            out.append(_valid_strings(json.loads(line)) if "\\u" in line else json.loads(line))
        except (ValueError, RecursionError):
            pass  # a line cut short by a crash
    return out


def append_jsonl(path, obj):
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
                        source=read_text(os.path.join(d, "harness.py"), ""),
                        meta=read_json(os.path.join(d, "meta.json"), {}),
                        scores=read_json(os.path.join(d, "scores.json")),
                        invalid=read_text(os.path.join(d, "invalid.txt"))))
    return out


def read_traces(cand):
    return read_jsonl(os.path.join(cand["dir"], "traces.jsonl"))


# The parent's own record of what it measured, outside the archive (the command proposer's agent
# gets a copy of the archive, never this file, and its jail cannot reach the run directory).
# Selection reads scores and the incumbent from here; a scores.json that differs is refused.

def ledger_path_for(archive_dir):
    return os.path.abspath(archive_dir).rstrip("/") + ".ledger.jsonl"


def read_ledger(path):
    """({cand: scores} as measured, {iteration: incumbent} as chosen) from the ledger file."""
    scores, incumbents = {}, {}
    for line in read_jsonl(path):
        if "scores" in line:
            scores[line["cand"]] = line["scores"]
        elif "incumbent" in line:
            incumbents[line["iteration"]] = line["incumbent"]
    return scores, incumbents


def trusted_archive(archive_dir, ledger_path):
    """(load_archive with every candidate's scores taken from the ledger, problems): a scores.json
    that differs from what the search measured (edited, planted, deleted) is put back as measured
    (or removed, if the search never scored that candidate) and listed in problems."""
    measured, _ = read_ledger(ledger_path)
    archive, problems = load_archive(archive_dir), []
    for c in archive:
        want, path = measured.get(c["name"]), os.path.join(c["dir"], "scores.json")
        if c["scores"] == want:
            continue
        if want is None:
            os.remove(path)
            problems.append(f"{c['name']}/scores.json: this search never scored {c['name']}; refused, removed")
        else:
            write_json(path, want)
            problems.append(f"{c['name']}/scores.json: {'missing' if c['scores'] is None else 'changed'} after "
                            "the search wrote it; refused, rewritten as measured")
        c["scores"] = want
    return archive, problems


def rank_key(cand):
    """The paper's order: success desc, then mean turns asc; ties go to the older candidate."""
    s = cand["scores"]
    return (-s["success"], s["mean_turns"], cand["num"])


def scored_whole(archive):
    """The candidates scored on every example of the search set: a candidate racing dropped
    (scores.json's dropped_after) was scored on fewer, so its success is not comparable."""
    return [c for c in archive if c["scores"] and not c["scores"].get("dropped_after")]


def paper_choice(archive):
    """The archive's top scorer in the paper's order (rank_key) among those scored whole: what the
    proposers edit (their parent) and what the sign test weighs against the incumbent. None if
    nothing scored."""
    scored = scored_whole(archive)
    return min(scored, key=rank_key) if scored else None


def score_records(records, example_ids):
    """Rollout records -> scores. per_example follows example_ids (the fixed order the paired
    test needs); an example with several rollouts gets their mean, one with none scores 0.
    led_refusals (only when there are any): moves the domain refused as led by the prompt."""
    by_id = {eid: [] for eid in example_ids}
    for r in records:
        if str(r.get("example_id")) in by_id:
            by_id[str(r.get("example_id"))].append(float(r.get("score") or 0.0))
    per_example = [sum(v) / len(v) if v else 0.0 for v in by_id.values()]

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0
    # moves a domain refused because the prompt led the model to them (chess: "play: led: ..."), if any
    led = sum(": led: " in str(t.get("error") or "") for r in records for t in r.get("tool_calls") or [])
    return dict(**({"led_refusals": led} if led else {}), success=mean(per_example),
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


def write_frontier(archive_dir):
    pts = [dict(cand=c["name"], success=c["scores"]["success"], mean_turns=c["scores"]["mean_turns"],
                mean_tokens=c["scores"]["mean_tokens"]) for c in scored_whole(load_archive(archive_dir))]
    write_json(os.path.join(archive_dir, "frontier.json"),
                dict(success_vs_turns=pareto(pts, "mean_turns"), success_vs_tokens=pareto(pts, "mean_tokens")))


def drop_token_ids(obj):
    # Token id lists are for phase A's training, useless to a proposer, and most of the bytes.
    if isinstance(obj, dict):
        return {k: drop_token_ids(v) for k, v in obj.items() if k not in ("prompt_ids", "completion_ids")}
    if isinstance(obj, list):
        return [drop_token_ids(v) for v in obj]
    return obj


# -----------------------------------------------------------------------------
# A finished run, packed: results/ keeps a run as two files, run.zip (its record: config.json,
# summary.json, metrics.jsonl, harnesses/, archive/) and report.html beside it to browse, so that
# the tree a reader opens is the code. Readers go through unpacked_run / unpacked_archive.

ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # every member gets this time, so packing the same files gives the same bytes
RUN_RECORD = ("config.json", "summary.json", "metrics.jsonl", "harnesses", "archive", "archive.zip")


def _write_zip(target, members):
    """members: (name, bytes) pairs -> target (names sorted, times fixed, deflated), atomically."""
    import zipfile
    tmp = target + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, data in sorted(members):
            info = zipfile.ZipInfo(name, ZIP_TIME)
            info.compress_type, info.external_attr = zipfile.ZIP_DEFLATED, 0o644 << 16
            z.writestr(info, data)
    os.replace(tmp, target)


def _files(folder, prefix, run_dir=None):
    """(prefix + path relative to folder, bytes) for every regular file below folder; a symbolic
    link is never followed into the zip (received.walk_files skips links, read_bytes refuses them)."""
    for name, path in received.walk_files(folder):
        yield prefix + name, received.read_bytes(path, root=run_dir or folder)


def pack_run(run_dir):
    """A finished run's record (RUN_RECORD: its archive/ folder or an older archive.zip's members
    go under archive/) -> run_dir/run.zip, then those files are removed; report.html, and
    checkpoints that results/ never keeps, stay. None when there is no summary.json (a run still
    going needs its files) or it is packed already."""
    import shutil
    run_dir = os.fspath(run_dir)
    if not os.path.isfile(os.path.join(run_dir, "summary.json")):
        return None
    members = []
    for name in RUN_RECORD:
        path = os.path.join(run_dir, name)
        if os.path.islink(path):
            continue  # a link is not the run's own file: never packed (nor what it points to)
        if name == "archive.zip" and os.path.isfile(path):
            members += list(_files(_unzipped(path), "archive/"))
        elif os.path.isdir(path):
            members += list(_files(path, name + "/", run_dir))
        elif os.path.isfile(path):
            members.append((name, received.read_bytes(path, root=run_dir)))
    target = os.path.join(run_dir, "run.zip")
    _write_zip(target, members)
    for name in RUN_RECORD:  # only once run.zip is whole (_write_zip renames it into place)
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    return target


_UNPACKED = {}  # zip file -> its temporary copy, so that a process unpacks each one once


def _unzipped(packed):
    """A temporary folder holding the zip file's members (removed when this process ends);
    ValueError naming the zip when it is not one or breaks received.extract_zip's caps."""
    import atexit
    import shutil
    import tempfile
    key = (os.path.realpath(packed), os.stat(packed).st_mtime_ns)
    if key not in _UNPACKED:
        tmp = tempfile.mkdtemp(prefix="whale_unpacked_")
        atexit.register(shutil.rmtree, tmp, True)
        try:  # checked: names inside tmp, member count, bytes and ratio capped (a zip bomb is refused)
            received.extract_zip(packed, tmp)
        except ValueError:
            shutil.rmtree(tmp, True)
            raise
        _UNPACKED[key] = tmp
    return _UNPACKED[key]


def unpacked_run(run_dir):
    """The folder that holds run_dir's record: run_dir itself, or a temporary copy unpacked from
    its run.zip. (By hand: python -m zipfile -e run.zip DIR)"""
    packed = os.path.join(run_dir, "run.zip")
    return _unzipped(packed) if os.path.isfile(packed) else os.fspath(run_dir)


def unpacked_archive(run_dir):
    """The folder that holds run_dir's archive: archive/ of the run or of its unpacked run.zip,
    or a temporary copy of an archive.zip (how results/preset and results/phase-a keep it);
    None when the run has none of them."""
    record = unpacked_run(run_dir)
    folder, packed = os.path.join(record, "archive"), os.path.join(record, "archive.zip")
    if os.path.isdir(folder):
        return folder
    return _unzipped(packed) if os.path.isfile(packed) else None


# -----------------------------------------------------------------------------
# a search's records: candidates, summary and iteration lines, events; a search opened or resumed

def sum_costs(archive_dir):
    """The costs recorded in summary.jsonl and iterations.jsonl, summed (a search's counters)."""
    total = Counter()
    for name in ("summary.jsonl", "iterations.jsonl"):
        for line in read_jsonl(os.path.join(archive_dir, name)):
            total.update({k: v for k, v in (line.get("cost") or {}).items() if isinstance(v, (int, float))})
    return {k: round(v, 6 if k.endswith("usd") else 3) if isinstance(v, float) else v for k, v in total.items()}


# How the primitives proposer made a candidate (kept in meta.json and summary.jsonl, shown by the
# report): kind = swap | combine | retry | pair, the axes it replaced, the candidates it took them
# from (the first is the one it was spliced into, also `parent`).
PROVENANCE = ("kind", "axes", "parents")


def write_candidate(archive_dir, num, cand, iteration, proposal_cost):
    """cand_NNN/ of a proposed candidate: harness.py, meta.json (and reply.txt), before it is checked."""
    d = os.path.join(archive_dir, cand_name(num))
    os.makedirs(d, exist_ok=True)
    src = cand.get("source") if isinstance(cand.get("source"), str) else ""
    reject = cand.get("reject")
    try:  # a source that is not valid Unicode is an invalid candidate, archived with U+FFFD in its place
        valid_text(src, "the candidate's source")
    except ValueError as e:
        src, reject = valid_text(src, replace=True), reject or str(e)
    with open(os.path.join(d, "harness.py"), "w") as f:
        f.write(src)
    if cand.get("raw"):
        with open(os.path.join(d, "reply.txt"), "w") as f:
            f.write(valid_text(str(cand["raw"]), replace=True))
    # The proposer's cost travels with the iteration's candidates so a resumed run can still
    # book it when it finishes the iteration. `reject` is a reason the proposer already knows
    # (a reply cut at the length limit, an edit that does not apply): kept so a resumed run
    # rejects the candidate for the same reason.
    if cand.get("kind") is None and src:  # an LLM's or an agent's merge says so in its first docstring line
        merged = re.match(r"\s*merge of (cand_\d+) and (cand_\d+)\b", (hypothesis(src) or ""), re.I)
        if merged:
            cand = dict(cand, kind="merge", parents=[cand.get("parent")] * bool(cand.get("parent")) + [
                        x for x in merged.groups() if x != cand.get("parent")])
    write_json(os.path.join(d, "meta.json"), dict(
        iteration=iteration, proposer=str(cand.get("proposer", "?")), parent=cand.get("parent"),
        axis=cand.get("axis"), note=valid_text(str(cand.get("note", ""))[:2000], replace=True),
        format=cand.get("format"), finish=cand.get("finish"), reject=reject, proposal_cost=proposal_cost,
        **{key: cand[key] for key in PROVENANCE if cand.get(key) is not None}))


def summary_line(c):
    """summary.jsonl's line of a finished candidate (scored or invalid)."""
    m, s = c["meta"], c["scores"]
    line = dict(cand=c["name"], iteration=m.get("iteration"), proposer=m.get("proposer"),
                parent=m.get("parent"), axis=m.get("axis"), format=m.get("format"), note=m.get("note"),
                hypothesis=hypothesis(c["source"]),
                **{key: m[key] for key in PROVENANCE if m.get(key) is not None})
    if s:
        line.update(status="ok", success=s["success"], mean_turns=s["mean_turns"],
                    mean_tokens=s["mean_tokens"], n=s["n"], status_counts=s["status_counts"],
                    cost=s.get("cost", {}), **({"dropped_after": s["dropped_after"]} if s.get("dropped_after") else {}))
    else:
        line.update(status="invalid", reason=(c["invalid"] or "").strip(),
                    cost=dict(candidates=1, invalid=1))
    return line


def candidate_event(line, **extra):
    """One log line for a finished candidate (from its summary line)."""
    keep = ("cand", "status", "success", "mean_turns", "dropped_after", "proposer", "kind", "parent", "parents", "axis",
            "format", "reason")
    ev = {k: line.get(k) for k in keep if line.get(k) is not None}
    if "reason" in ev:
        ev["reason"] = str(ev["reason"])[:300]
    return dict(event="harness_candidate", **ev, **extra)


def iteration_event(line, **extra):
    """One log line for a finished iteration (from its iterations.jsonl line)."""
    return dict(event="harness_iteration", **{k: v for k, v in line.items() if k != "cost"}, **extra)


def open_search(archive_dir, incumbent_src, ids, allowed, k, ledger_path, log) -> str:
    """A search's archive made ready, new or resumed; returns iterations.jsonl's path. New: rules.json,
    an empty ledger, cand_000 (the incoming harness). Resumed: the ledger (when it is missing, an
    archive_integrity event and nothing of the archive's files trusted), what differs from it refused
    and logged (archive_integrity), the
    summary lines a crash lost added, and the finished work's events replayed into `log`
    (replayed=True, each iteration's candidates then the iteration), so that a log cut back to a
    checkpoint holds one line per event. Refuses an archive of another incoming harness or of
    other examples (ValueError)."""
    os.makedirs(archive_dir, exist_ok=True)
    # Proposers read the restriction from the archive, so the flag is not threaded through them.
    write_json(os.path.join(archive_dir, "rules.json"), dict(allowed_axes=allowed, k=k))
    summary_path = os.path.join(archive_dir, "summary.jsonl")
    iters_path = os.path.join(archive_dir, "iterations.jsonl")
    if not os.path.exists(ledger_path):  # a new search; or the ledger was removed: nothing the archive says is trusted
        scored = [c["name"] for c in load_archive(archive_dir) if c["scores"]]
        if scored or read_jsonl(iters_path):  # (the ledger is made before the archive's first score)
            log(dict(event="archive_integrity", reason=f"the ledger {os.path.basename(ledger_path)} is missing: the "
                     f"archive's scores ({len(scored)} candidates) and incumbents are not trusted; its candidates "
                     "are measured again, iteration by iteration (the old records kept as *.untrusted.jsonl)"))
            for path in (iters_path, summary_path):
                if os.path.exists(path):
                    os.replace(path, path[:-len(".jsonl")] + ".untrusted.jsonl")
        open(ledger_path, "a").close()
    archive, problems = trusted_archive(archive_dir, ledger_path)  # (also: killed between the ledger and scores.json)
    for p in problems:
        log(dict(event="archive_integrity", reason=p))
    first = next((c for c in archive if c["num"] == 0), None)
    if first is not None and normalized(first["source"]) != normalized(incumbent_src):
        raise ValueError(f"{archive_dir} holds a different cand_000; use a fresh archive_dir per phase")
    if first is None or "iteration" not in first["meta"]:
        write_candidate(archive_dir, 0, dict(source=incumbent_src, proposer="incoming",
                                             note="the incoming harness h0 of this phase"), 0, None)
    for c in archive:  # a resumed archive must be about the same examples, in the same order (racing: a prefix)
        if c["scores"] and c["scores"].get("example_ids") != ids[:c["scores"].get("dropped_after") or len(ids)]:
            raise ValueError(f"{c['name']} was scored on other examples than these")
    # Crash between scores.json and its summary line: add the missing lines (append-only).
    done = {line.get("cand") for line in read_jsonl(summary_path)}
    for c in archive:
        if (c["scores"] or c["invalid"]) and c["name"] not in done:
            append_jsonl(summary_path, summary_line(c))
    # Resumed: replay the finished work's events in the order they happened (each iteration's
    # candidates, then the iteration), so a log cut back to a checkpoint is whole.
    finished = read_jsonl(summary_path)
    for line in read_jsonl(iters_path):
        for cand in finished:
            if cand.get("iteration") == line["iteration"]:
                log(candidate_event(cand, replayed=True))
        log(iteration_event(line, replayed=True))
    for cand in finished:  # of the iteration a crash interrupted
        if cand.get("iteration") is not None and cand["iteration"] >= len(read_jsonl(iters_path)):
            log(candidate_event(cand, replayed=True))
    return iters_path
