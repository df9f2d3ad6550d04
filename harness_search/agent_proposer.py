"""agent_proposer.py: phase B's command proposer, an external coding agent (Claude Code's
`claude -p`, Codex's `codex exec`, ...) run in a copy of the archive, as in the paper. It reads
the files it wants and writes new/*.py; its cost and tokens are read from its JSON output.
proposers.make_proposer("command", ...) builds it; the archive digest, the traces and the rules
it shows the agent are archive_view.py's, the failure signatures primitives.py's.

Why the command proposer's agent works in a copy (issue: an agent in the archive could edit
cand_000/scores.json and selection would trust it): selection reads scores.json, meta.json and
harness.py, so the agent must not be able to write them. Of the designs (digests kept outside
the archive and checked; a copy the agent works in), the copy is the simplest sound one: every
call gets a fresh temporary directory holding a copy of the archive; only regular files named
new/cand_N.py directly under new/ (no symbolic links, at most MAX_CANDIDATE_BYTES) are read back,
and every other change the agent made there is listed in the proposer's errors (a snapshot
before and after). Everything the agent leaves is read with bounds: its output (agent_jail), the
snapshot (walk(): SNAP_* limits on entries, depth and bytes, no recursion), new/ (a bad file
costs that file), and the copy is removed by remove_tree, whatever its depth; a step that fails
is a line in the errors, never the call's candidates. agent_jail.py keeps the agent inside that
copy (uid nobody, namespaces, an egress proxy, Landlock, seccomp: see there); behind it (a kernel without Landlock), the real archive is
snapshotted too (files up to KEEP_BYTES kept in memory), any change made during the call is
undone and reported, and new files in the run directory, the repository and the top of /tmp
are listed. Selection itself trusts only the parent's ledger (meta_harness.py). The copy also
holds reading aids (write_workspace): GUIDE.md, OUTCOMES.md + outcomes.tsv, failures/.

What it leaves out: cleanup of the agent's copy after a kill -9 of whale.py; parallel agent calls.
"""

import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import tempfile
import time

from harness_search import harness_archive
from harness_search import harness_source
from harness_search.primitives import failure_signatures
from harness_search.proposal import Proposal  # what every proposer returns
from harness_search.archive_view import DIGEST_CHARS, RULES, archive_digest, id_list, outcomes_vs, render_trace, short

MAX_CANDIDATE_BYTES = 200_000  # a harness file is ~3-5 kB; anything this big is not one
KEEP_BYTES = 1 << 20           # archive files up to this size are restorable after an agent call


SNAP_ENTRIES = 20_000      # entries one snapshot records; past that it stops and says so
SNAP_DEPTH = 32            # directory levels it looks into
SNAP_FILE_BYTES = 4 << 20  # bytes of one file it reads (the digest covers them, the size and the mtime)
SNAP_BYTES = 128 << 20     # bytes of all files it reads together


def walk(root, max_depth=SNAP_DEPTH, max_entries=SNAP_ENTRIES, problems=None, prune=None):
    """(path, lstat) for everything under root, without recursion and without following links;
    at most max_depth levels and max_entries entries, each limit reached is one line in
    `problems`; a directory for which prune(path) is true is neither listed nor entered. An
    entry that vanishes or cannot be read is skipped."""
    stack, n = [(root, 0)], 0
    while stack:
        d, depth = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if n >= max_entries:
                if problems is not None:
                    problems.append(f"{root}: more than {max_entries} entries; the rest not looked at")
                return
            if prune and e.is_dir(follow_symlinks=False) and prune(e.path):
                continue
            n += 1
            try:
                st = os.lstat(e.path)
            except OSError:
                continue
            yield e.path, st
            if stat.S_ISDIR(st.st_mode):
                if depth + 1 < max_depth:
                    stack.append((e.path, depth + 1))
                elif problems is not None:
                    problems.append(f"{os.path.relpath(e.path, root)}: deeper than {max_depth} levels; not looked into")


def _read_at_most(path, limit):
    """The first `limit` bytes of a regular file (O_NOFOLLOW | O_NONBLOCK: a link or a fifo swapped
    in is refused, never followed or waited on), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read(limit)


def snapshot(root, keep_bytes=0, problems=None):
    """{path relative to root: (kind, size, digest, data)} for everything under root, with the
    limits above (each one reached is a line in `problems`). kind is file | dir | link | other;
    symbolic links are recorded (digest = their target), never followed; a file's digest covers
    its first SNAP_FILE_BYTES (its size, allocated blocks and mtime besides: a sparse 64 GB file
    costs what it allocates, nothing); data = the bytes of files up to keep_bytes (to restore
    them), else None."""
    out, budget = {}, SNAP_BYTES
    problems = [] if problems is None else problems
    for path, st in walk(root, problems=problems):
        rel = os.path.relpath(path, root)
        if stat.S_ISLNK(st.st_mode):
            try:
                out[rel] = ("link", 0, os.readlink(path), None)
            except OSError:
                out[rel] = ("other", 0, "unreadable", None)
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", 0, "", None)
        elif stat.S_ISREG(st.st_mode):
            data = _read_at_most(path, max(0, min(SNAP_FILE_BYTES, budget))) or b""
            budget -= len(data)
            if st.st_size > len(data) and budget <= 0:
                problems.append(f"{root}: over {SNAP_BYTES} bytes read; later files compared by size and mtime only")
                budget = 0
            digest = f"{hashlib.sha256(data).hexdigest()}:{st.st_blocks}:{st.st_mtime_ns}"
            out[rel] = ("file", st.st_size, digest, data if st.st_size <= keep_bytes and len(data) == st.st_size
                        else None)
        else:
            out[rel] = ("other", 0, "", None)
    problems[:] = list(dict.fromkeys(problems))
    return out


def remove_tree(top):
    """rm -rf top, not following links, for a tree of any depth: each directory's contents are
    moved up into `top` (renamed), then it is removed; no recursion and no long paths. Returns
    what could not be removed ([] when top is gone)."""
    if not os.path.lexists(top):
        return []
    if not os.path.isdir(top) or os.path.islink(top):
        try:
            os.unlink(top)
            return []
        except OSError as e:
            return [f"{top}: {e.strerror}"]
    stuck, n = {}, 0
    while True:
        try:
            with os.scandir(top) as it:
                entries = [e for e in it if e.name not in stuck]
        except OSError as e:
            return [f"{top}: {e.strerror}"]
        dirs = []
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    dirs.append(e.name)
                else:
                    os.unlink(e.path)
            except OSError as err:
                stuck[e.name] = err.strerror
        if not dirs:
            break
        for d in dirs:
            path = os.path.join(top, d)
            try:
                with os.scandir(path) as it:
                    for e in it:
                        n += 1
                        os.rename(e.path, os.path.join(top, f".rm{n}"))
                os.rmdir(path)
            except OSError as err:
                stuck[d] = err.strerror
    try:
        os.rmdir(top)
        return []
    except OSError as e:
        return [f"{top}: {e.strerror}"] + [f"{top}/{name}: {why}" for name, why in sorted(stuck.items())[:8]]


def changed_paths(before, after):
    """[(path, 'added' | 'deleted' | 'changed')] between two snapshots, sorted by path."""
    out = [(p, "added") for p in after if p not in before]
    out += [(p, "deleted") for p in before if p not in after]
    out += [(p, "changed") for p in before if p in after and before[p][:3] != after[p][:3]]
    return sorted(out)


def _remove(path):
    remove_tree(path)


def restore(root, before, after):
    """Undo the changes between the snapshots `before` and `after` of root: added paths are
    removed, deleted or changed files are rewritten from the bytes `before` kept. Returns
    [(path, what happened)]."""
    report = []
    for path, how in changed_paths(before, after):
        full = os.path.join(root, path)
        b = before.get(path)
        if how == "added":
            _remove(full)
            report.append((path, "added by the agent, removed"))
        elif b[0] == "dir":
            if os.path.lexists(full) and not (os.path.isdir(full) and not os.path.islink(full)):
                _remove(full)
            os.makedirs(full, exist_ok=True)
            report.append((path, f"{how}, directory restored"))
        elif b[0] == "file" and b[3] is not None:
            if os.path.lexists(full) and (os.path.islink(full) or os.path.isdir(full)):
                _remove(full)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(b[3])
            report.append((path, f"{how}, restored"))
        else:
            report.append((path, f"{how}, NOT restored (larger than {KEEP_BYTES} bytes)"))
    return report


def _list(pairs, n=8):
    shown = ", ".join(f"{p} ({how})" for p, how in pairs[:n])
    return shown + (f" and {len(pairs) - n} more" if len(pairs) > n else "")


def collect_candidates(new_dir, k, max_bytes=MAX_CANDIDATE_BYTES, max_entries=100_000):
    """(files, problems): [(name, source)] for regular files new/cand_N.py directly under
    new_dir, in number order, the first k; problems = why any other entry was ignored (a bad
    file costs that file only; entries not named like a candidate are one line together). At
    most max_entries names are looked at."""
    files, problems = [], []
    try:
        with os.scandir(new_dir) as it:
            names = [e.name for _, e in zip(range(max_entries + 1), it)]
    except OSError as e:
        return [], [f"new/: unreadable ({e.strerror})"]
    if len(names) > max_entries:
        problems.append(f"new/: more than {max_entries} entries; the rest not looked at")
        names = names[:max_entries]
    other = sorted(n for n in names if not re.fullmatch(r"cand_\w+\.py", n))
    if other:
        problems.append(f"new/: {len(other)} entries not named new/cand_N.py ("
                        + ", ".join(short(n, 60) for n in other[:5]) + (", ..." if len(other) > 5 else "") + ")")
    names = sorted(set(names) - set(other), key=lambda f: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", f)])
    for name in names:
        path = os.path.join(new_dir, name)
        try:
            st = os.lstat(path)
        except OSError as e:
            problems.append(f"new/{name}: unreadable ({e.strerror})")
            continue
        if stat.S_ISLNK(st.st_mode):
            problems.append(f"new/{name}: a symbolic link, not a file")
        elif not stat.S_ISREG(st.st_mode):
            problems.append(f"new/{name}: not a regular file")
        elif st.st_size > max_bytes:
            problems.append(f"new/{name}: {st.st_size} bytes, over the {max_bytes}-byte cap")
        elif len(files) >= k:
            problems.append(f"new/{name}: more than the {k} files asked for")
        else:
            data = _read_at_most(path, max_bytes + 1)  # a link or fifo swapped in after the check: refused
            if data is None or len(data) > max_bytes:
                problems.append(f"new/{name}: changed while being read")
            else:
                files.append((name, data.decode("utf-8", "replace")))
    return files, problems


def _count(d, key):
    return int(d[key]) if isinstance(d.get(key), (int, float)) else 0


def agent_usage(stdout):
    """Tokens and cost an agent CLI printed on stdout, as dict(prompt_tokens, completion_tokens,
    cost_usd, errors, reported):
    - Claude Code, `claude -p --output-format json`: one object {"type": "result", "subtype",
      "is_error", "result", "total_cost_usd", "usage": {"input_tokens",
      "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens"}, ...};
      `--output-format stream-json` ends with the same object on its last line. Prompt tokens
      = input + cache creation + cache reads (the three are disjoint there).
    - Codex CLI, `codex exec --json`: JSON Lines; every {"type": "turn.completed", "usage":
      {"input_tokens", "cached_input_tokens", "output_tokens"}} adds to the totals (cached
      tokens are part of input_tokens there); "turn.failed" and "error" events are errors.
      Codex reports no cost, so cost_usd stays 0.
    Anything else (plain text) reports nothing."""
    out = dict(prompt_tokens=0, completion_tokens=0, cost_usd=0.0, errors=[], reported=False)
    text = (stdout or "").strip()
    try:
        objs = [json.loads(text)]
    except (ValueError, RecursionError):  # (RecursionError: absurdly nested output)
        objs = []
        for line in text.splitlines():
            if line.strip().startswith("{"):
                try:
                    objs.append(json.loads(line))
                except (ValueError, RecursionError):
                    pass
    for o in objs:
        if not isinstance(o, dict):
            continue
        u = o.get("usage") if isinstance(o.get("usage"), dict) else {}
        if o.get("type") == "result" or "total_cost_usd" in o:  # Claude Code
            out["reported"] = True
            out["prompt_tokens"] += _count(u, "input_tokens") + _count(u, "cache_creation_input_tokens") + \
                _count(u, "cache_read_input_tokens")
            out["completion_tokens"] += _count(u, "output_tokens")
            if isinstance(o.get("total_cost_usd"), (int, float)):
                out["cost_usd"] += float(o["total_cost_usd"])
            if o.get("is_error"):
                out["errors"].append(f"agent reported an error ({o.get('subtype')}): {short(o.get('result'), 200)}")
        elif o.get("type") == "turn.completed":  # Codex CLI
            out["reported"] = True
            out["prompt_tokens"] += _count(u, "input_tokens")
            out["completion_tokens"] += _count(u, "output_tokens")
        elif o.get("type") in ("turn.failed", "error"):
            msg = (o.get("error") or {}).get("message") if isinstance(o.get("error"), dict) else o.get("message")
            out["errors"].append(f"agent reported an error ({o.get('type')}): {short(msg, 200)}")
    return out


def _copy_archive(archive_dir, work):
    """What the agent may read: the candidates' folders and the archive's record files."""
    for name in sorted(os.listdir(archive_dir)):
        src = os.path.join(archive_dir, name)
        if re.fullmatch(r"cand_\d{3,}", name) and os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, os.path.join(work, name), symlinks=True)
        elif name in ("summary.jsonl", "iterations.jsonl", "frontier.json", "rules.json") and os.path.isfile(src):
            shutil.copyfile(src, os.path.join(work, name))


FAILURE_KINDS = {  # what each failure signature (failure_signatures) means, for the agent's failures/ files
    "error": "the harness crashed, timed out, or a tool call raised",
    "no_answer": "the rollout ended without an answer (parsing or stopping lost it)",
    "no_tool": "answered without calling any tool",
    "truncated": "answered wrong while a tool output it saw was cut short (the answer may be in the cut part)",
    "unsupported": "answered, but the answer is nowhere in the tool outputs (retrieval or tool use missed it)",
    "wrong": "the answer came from the tool output and was still wrong (instructions, format)",
}


def write_workspace(archive_dir, work, domain, traces_per_kind=3):
    """The agent's reading aids, written into its copy (they are derived from the archive, so an
    edit to them changes nothing): GUIDE.md (what is where, the contract, the limits, the rules),
    OUTCOMES.md + outcomes.tsv (per example, what each candidate won and lost against its parent,
    and every candidate's score on every example), failures/cand_NNN.md (its failed rollouts
    grouped by failure kind, a few traces of each)."""
    from jail import sandbox  # its limits, for the guide
    archive = harness_archive.load_archive(archive_dir)
    by_name = {c["name"]: c for c in archive}
    scored = [c for c in archive if c["scores"]]
    rules = harness_archive.read_json(os.path.join(archive_dir, "rules.json"), {}) or {}
    with open(os.path.join(work, "GUIDE.md"), "w") as f:
        f.write(GUIDE.format(skill=domain.SKILL, rules=RULES, k=rules.get("k", "k"),
                             allowed="" if rules.get("allowed_axes") is None else
                             f"\n- prompt-only search: only the top-level names {rules['allowed_axes']} may change",
                             max_prompt=sandbox.MAX_PROMPT_CHARS, max_messages=sandbox.MAX_MESSAGES))
    rows = ["# Outcomes per example", "", "Won / lost = examples on which the candidate scored above / below "
            "its parent (same examples, same order). outcomes.tsv: every candidate's score on every example.", "",
            "cand | parent | success | parent's | won | lost | won on | lost on", "--- | --- | --- | --- | --- | --- | --- | ---"]
    for c in scored:
        parent = by_name.get(c["meta"].get("parent") or "")
        wl = outcomes_vs(c, parent) if parent and parent["scores"] else None
        won, lost = wl if wl else ([], [])
        rows.append(f"{c['name']} | {parent['name'] if parent else '-'} | {c['scores']['success']:.3f} | "
                    f"{parent['scores']['success']:.3f} | {len(won)} | {len(lost)} | {id_list(won, 40)} | "
                    f"{id_list(lost, 40)}"
                    if wl else f"{c['name']} | - | {c['scores']['success']:.3f} | - | - | - | - | -")
    with open(os.path.join(work, "OUTCOMES.md"), "w") as f:
        f.write("\n".join(rows) + "\n")
    if scored:
        ids = scored[0]["scores"]["example_ids"]
        with open(os.path.join(work, "outcomes.tsv"), "w") as f:
            f.write("\t".join(["example_id"] + [c["name"] for c in scored]) + "\n")
            for j, eid in enumerate(ids):
                f.write("\t".join([str(eid)] + [f"{c['scores']['per_example'][j]:.3g}" for c in scored]) + "\n")
    os.makedirs(os.path.join(work, "failures"), exist_ok=True)
    for c in scored:
        groups = {}
        for r in harness_archive.read_traces(c):
            kind = next(iter(failure_signatures([r])), None)
            if kind:
                groups.setdefault(kind, []).append(r)
        parts = [f"# {c['name']}: failed rollouts by kind ({sum(map(len, groups.values()))} of "
                 f"{c['scores']['rollouts']})"]
        for kind, recs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            parts.append(f"\n## {kind}: {len(recs)} rollouts. {FAILURE_KINDS.get(kind, '')}\n"
                         f"examples: {id_list([r.get('example_id') for r in recs], 40)}\n")
            parts += [render_trace(r, 2000) + "\n" for r in recs[:traces_per_kind]]
        with open(os.path.join(work, "failures", c["name"] + ".md"), "w") as f:
            f.write("\n".join(parts) + "\n")


GUIDE = """---
name: whale-harness-proposer
description: Write new harness files for a Meta-Harness search from this copy of its archive.
---
# Guide to this directory

## What is where
- PROPOSE.md: your task for this call (how many files, where to write them).
- OUTCOMES.md: per candidate, the examples it won and lost against its parent; outcomes.tsv:
  every candidate's score on every example (find the examples no candidate solves).
- failures/cand_NNN.md: that candidate's failed rollouts grouped by failure kind, a few full
  traces of each; read these first.
- cand_NNN/harness.py (source), scores.json (success, mean turns/tokens, per-example scores in
  the order of example_ids), traces.jsonl (every rollout: model calls, tool calls, answer,
  score), meta.json (proposer, parent, note), invalid.txt (why it was rejected).
- summary.jsonl (one line per candidate, with its hypothesis), iterations.jsonl (each
  iteration: the best, the acceptance test, the incumbent), frontier.json.
- new/: write your files here, new/cand_1.py ... new/cand_{k}.py. Nothing else is read back;
  any other change is reported. This copy is deleted after the call.

## The harness contract
{skill}

## Tools and their limits
- Every llm() and tools.<name>() call goes to the parent process, which checks it: at most
  {max_prompt} characters and {max_messages} messages per llm() call, a per-rollout deadline that
  counts model and tool time, a call budget. A refused call raises ToolError in the harness.
- The harness runs jailed: standard library only, no files outside its scratch directory, no
  network, no processes.
- You (the agent) run jailed too, as an unprivileged user: you can read the system and this
  directory, write only this directory and your HOME, and reach the network only through the
  HTTPS proxy in HTTPS_PROXY, to your API's host. The data, the test split and the run directory
  are not readable; do not look for them.

## What the rules check, in order
- the file parses and defines run(task, llm, tools) at top level; it imports only the
  standard library; it is not a copy of an archived candidate (compared without comments,
  layout or docstrings){allowed};
- it runs one task in the sandbox without crashing;
- then it is evaluated on the search set; it replaces the incumbent only if a paired sign
  test on the same examples says it is better beyond noise.

{rules}

Start the module docstring with one line stating the hypothesis (the mechanism and why it
should help); it is kept as the candidate's hypothesis in summary.jsonl and the report.
"""


def command_prompt(domain, archive_dir, k, digest_chars=DIGEST_CHARS):
    allowed = (harness_archive.read_json(os.path.join(archive_dir, "rules.json"), {}) or {}).get("allowed_axes")
    restrict = "" if allowed is None else (
        f"\n- PROMPT-ONLY SEARCH: change ONLY the top-level definitions {allowed} of the best "
        "candidate; every other top-level definition must stay exactly as it is.")
    return (
        f"# Propose {k} new harness files\n\nYou are the proposer of a Meta-Harness search. "
        "This directory is a copy of the archive of the search so far:\n"
        "- cand_NNN/harness.py: each candidate's source; cand_NNN/scores.json: its success rate, "
        "mean turns/tokens and per-example scores (in the order of example_ids); "
        "cand_NNN/traces.jsonl: every rollout (model calls, tool calls, answer, score); "
        "cand_NNN/invalid.txt: why a candidate was rejected\n"
        "- summary.jsonl (one line per candidate), iterations.jsonl, frontier.json\n"
        "- GUIDE.md (read it first: the files, the contract, the limits, the rules), OUTCOMES.md and "
        "outcomes.tsv (examples won and lost), failures/cand_NNN.md (failed traces by failure kind)\n"
        "Read the sources and especially the traces of failed and successful rollouts.\n\n"
        f"## Task\n{domain.SKILL}\n\n{RULES}{restrict}\n\n"
        f"## Output\nWrite exactly {k} files new/cand_1.py ... new/cand_{k}.py, each a complete "
        "harness whose module docstring starts with one line naming its mechanism; a file built on "
        "another candidate than the best says so with a docstring line `Parent: cand_NNN`. Only "
        "regular files new/cand_N.py are read back; changes anywhere else in this directory are "
        "ignored and reported.\n\n"
        f"{archive_digest(archive_dir, digest_chars, with_traces=False)}\n")


def command_proposer(domain, command, timeout, digest_chars, workdir_root=None, env_names=(), private=(),
                     hosts=None):
    from jail import agent_jail
    hosts = agent_jail.DEFAULT_HOSTS if hosts is None else tuple(hosts)


    def propose(archive_dir, k):
        errors, spent = [], dict(calls=0, prompt_chars=0, completion_chars=0, prompt_tokens=0, completion_tokens=0,
                                 cost_usd=0.0, seconds=0.0)
        archive = harness_archive.load_archive(archive_dir)
        names = {c["name"] for c in archive}
        best = harness_archive.paper_choice(archive)
        prompt = command_prompt(domain, archive_dir, k, digest_chars)
        spent["calls"] += 1
        spent["prompt_chars"] += len(prompt)

        def step(what, fn, default=None):  # one failing step costs its own report, never the candidates
            try:
                return fn()
            except Exception as e:
                errors.append(f"integrity: {what} failed ({type(e).__name__}: {short(str(e), 200)})")
                return default
        # root/archive: its copy (cwd); root/home: its HOME and TMPDIR. Both writable, nothing else.
        root = tempfile.mkdtemp(prefix="whale-agent-", dir=workdir_root)
        work, home = os.path.join(root, "archive"), os.path.join(root, "home")
        out = err = ""
        files, rc, timed_out, network, t0 = [], None, False, [], time.time()
        try:
            os.makedirs(work)
            os.makedirs(home)
            _copy_archive(archive_dir, work)
            write_workspace(archive_dir, work, domain)
            os.makedirs(os.path.join(work, "new"))
            path = os.path.join(work, "PROPOSE.md")
            with open(path, "w") as f:
                f.write(prompt)
            work_before = snapshot(work)
            archive_before = snapshot(archive_dir, keep_bytes=KEEP_BYTES)
            since = time.time()
            # The prompt goes to stdin (claude -p and codex exec - read it there) and is in
            # PROPOSE.md ({prompt_file} in the command names it). agent_jail.py: its own PID
            # namespace (all it starts ends with the call), Landlock, a scrubbed environment.
            try:
                res = agent_jail.run_agent(command.replace("{prompt_file}", shlex.quote(path)), work, home, prompt,
                                           timeout, env_names, private=_private_paths(archive_dir, private),
                                           hosts=hosts)
                out, err, rc, timed_out, network = res["out"], res["err"], res["rc"], res["timed_out"], res["network"]
                errors += [f"command: {n}" for n in res["notes"]]
                if timed_out:
                    errors.append(f"command: timed out after {timeout:g}s; collecting what it wrote")
                elif rc:  # one error per line of its stderr's end: every refusal it met is listed
                    tail = [x for x in (err or out or "").splitlines() if x.strip()][-20:]
                    errors.append(f"command: exit status {rc}")
                    errors += [f"command: stderr: {short(x, 240)}" for x in tail]
                refused = list(dict.fromkeys(f"{n['host']}:{n['port']}: {n['why']}" if n["host"] else n["why"]
                                             for n in network if not n["allowed"]))
                errors += [f"network: refused {x}" for x in refused[:8]]
            except OSError as e:
                res = {}
                errors.append(f"command: could not start: {e}")
            # What the agent wrote first: nothing below may cost the candidates.
            files, problems = step("reading new/", lambda: collect_candidates(os.path.join(work, "new"), k), ([], []))
            for p in problems:
                errors.append(f"integrity: ignored {p}")
            outside = step("looking for writes outside its copy", lambda: writes_outside(
                archive_dir, since, skip=[root, archive_dir], tmp=not res.get("landlock"),
                more=[p for p in private if os.path.isdir(p)]), [])
            if outside:
                errors.append("integrity: written outside its copy during the call (by the agent or "
                                      f"another process): {_list([(p, 'written') for p in outside])}")
            # The real archive: nothing the agent did there may reach selection.
            undone = step("checking the archive", lambda: restore(archive_dir, archive_before, snapshot(archive_dir)),
                          [])
            if undone:
                errors.append("integrity: the archive itself changed while the agent ran (it works in a "
                                      f"copy): {_list(undone)}")
            limits = []
            elsewhere = step("comparing its copy", lambda: [
                (p, how) for p, how in changed_paths(work_before, snapshot(work, problems=limits))
                if p != "new" and not p.startswith("new" + os.sep)], [])
            if elsewhere:
                errors.append(f"integrity: the agent changed files outside new/ (ignored): {_list(elsewhere)}")
            errors += [f"integrity: {x}" for x in limits[:4]]
        finally:
            left = remove_tree(root)
            if left:
                errors.append(f"integrity: its copy could not be removed: {_list([(x, 'left') for x in left])}")
        seconds = time.time() - t0
        spent["seconds"] += seconds
        usage = agent_usage(out)
        errors += [f"command: {e}" for e in usage["errors"]]
        for key in ("prompt_tokens", "completion_tokens", "cost_usd"):
            spent[key] += usage[key]
        cands = []
        for fname, src in files:
            doc = (harness_source.docstring(src) or "").strip()
            m = re.search(r"^\s*parent:\s*(cand_\d{3,})\b", doc, re.M | re.I)
            cands.append(dict(source=src, proposer="command", format="file",
                              parent=m.group(1) if m and m.group(1) in names else (best["name"] if best else None),
                              note=(doc.splitlines() or [""])[0][:300] or f"(new/{fname}, no docstring)"))
        spent["completion_chars"] += len(out or "") + sum(len(c["source"]) for c in cands)
        if not cands:
            errors.append("command: no new/cand_*.py files were written")
        # What the agent was told and said (its output is already bounded), and one line per call.
        with open(os.path.join(archive_dir, "PROPOSE.md"), "w") as f:
            f.write(prompt)
        with open(os.path.join(archive_dir, "PROPOSE.log"), "w") as f:
            f.write((out or "") + ("\n--- stderr ---\n" + err if err else ""))
        harness_archive.append_jsonl(os.path.join(archive_dir, "proposer_calls.jsonl"), dict(
            time=round(t0, 3), command=command, exit=rc, timed_out=timed_out, seconds=round(seconds, 3),
            files=[f for f, _ in files], errors=list(errors), network=network[:50],
            usage={k_: v for k_, v in usage.items() if k_ != "errors"}))
        return Proposal(cands, errors, False, spent)
    return propose


def _private_paths(archive_dir, extra=()):
    """What the agent must never read, should a directory it is granted hold one of them: the
    archive itself and the run directory above it, the repository's data/, WHALE_DATA, $HOME."""
    run_dir = os.path.dirname(os.path.abspath(archive_dir))
    repo = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the repository's root
    return [archive_dir, run_dir, os.path.join(repo, "data"), os.environ.get("WHALE_DATA"),
            os.path.expanduser("~"), *extra]


def writes_outside(archive_dir, since, skip=(), tmp=True, more=(), max_entries=20000):
    """Paths written since `since` (mtime or ctime) in the places an agent that got out of its
    copy would write: the archive's parent, the directories in `more` (whale.py: the run
    directory), the repository and, with tmp, the top level of the temporary directory (other
    processes write there too: only asked when the agent ran without its Landlock jail, which
    refuses /tmp). `skip`: directories not to report. Walked with walk()'s limits."""
    repo = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the repository's root
    roots = [(os.path.dirname(os.path.abspath(archive_dir)), SNAP_DEPTH), *[(d, SNAP_DEPTH) for d in more],
             (repo, SNAP_DEPTH)] + [(tempfile.gettempdir(), 1)] * tmp
    skip = [os.path.realpath(p) for p in skip]
    found = []
    for top, depth in roots:
        top = os.path.realpath(top)
        if any(_inside(top, s) for s in skip):
            continue
        prune = lambda p: os.path.basename(p) == ".git" or any(_inside(p, s) for s in skip)
        for path, st in walk(top, max_depth=depth, max_entries=max_entries, prune=prune):
            if any(_inside(path, s) for s in skip):
                continue
            if max(st.st_mtime, st.st_ctime) >= since and path not in found:
                found.append(path)
    return sorted(found)


def _inside(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")
