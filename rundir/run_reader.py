"""
run_reader.py: the one place that knows a run directory's files, for the pages that show runs
(report.py). read_run(run_dir) returns everything a page needs as plain dicts and lists: config,
summary, metrics, the checkpoint's state, the harnesses, and each harness phase's archive with its
candidates (their traces are read only when asked for, read_traces: they are most of the bytes).

A run directory is someone else's work (a run.zip, a folder sent over): every file is read through
jail/received.py, with no symbolic link below the run followed and every file's size capped; a file
that cannot be read as what it should be is a BadRun naming it, and a missing one gives None or [].
A committed run packed into run.zip (results/) is read through harness_archive.unpacked_run.

Left out: the model checkpoints (a page never loads weights) and any interpretation of the records
(report.py renders them; rundir/phases.py splits a run into its phases).
"""
import os
from pathlib import Path

from harness_search.harness_archive import unpacked_archive, unpacked_run
from jail import received  # everything read from the run: someone else's files

class BadRun(ValueError):
    """A file of the run that cannot be read as what it should be (a link, too big, not JSON ...)."""


def _received(read, path, absent, root):
    """read(path, root=root) from jail/received.py; `absent` when the file is not there; any other
    failure (a link, too big, not JSON ...) is a BadRun naming the file."""
    try:
        return read(path, root=root)
    except FileNotFoundError:
        return absent
    except (OSError, ValueError) as e:
        raise BadRun(str(e)) from None


def read_json(path, default=None, root=None):
    """The file's JSON (default when absent). root: the run directory, below which no link is followed."""
    return _received(received.read_json, path, default, root)


def read_jsonl(path, root=None):
    """Every line that parses (a line cut short by a crash is skipped); [] when absent."""
    return _received(lambda f, root: received.read_jsonl(f, root=root)[0], path, [], root)


def read_text(path, default=None, root=None):
    return _received(received.read_text, path, default, root)


def read_candidate(cand_dir, root=None):
    """One archived candidate: its source, meta.json, scores.json (None until evaluated),
    invalid.txt (the rejection reason, or None) and the proposer's raw reply (or None)."""
    cand_dir = Path(cand_dir)
    root = root or cand_dir  # (no symbolic link below root is followed)
    name = cand_dir.name
    return dict(name=name, num=int(name.split("_")[-1]) if name.split("_")[-1].isdigit() else -1,
                dir=str(cand_dir), root=root, source=read_text(cand_dir / "harness.py", root=root),
                meta=as_dict(read_json(cand_dir / "meta.json", root=root)),
                scores=read_json(cand_dir / "scores.json", root=root),
                invalid=read_text(cand_dir / "invalid.txt", root=root), reply=read_text(cand_dir / "reply.txt", root=root),
                has_traces=(cand_dir / "traces.jsonl").exists())


def read_traces(cand):
    """The candidate's rollout records (read only when rendered: they are most of the bytes),
    or None when its traces.jsonl was not kept."""
    path = Path(cand["dir"]) / "traces.jsonl"
    return read_jsonl(path, root=cand["root"]) if path.exists() else None


def _folders(d):
    """The sub-folders of d, none of them a symbolic link."""
    return sorted(p for p in Path(d).iterdir() if p.is_dir() and not p.is_symlink())


def read_phase(archive_dir, root=None):
    """One harness phase's archive: rules, iterations.jsonl, summary.jsonl, frontier and the
    candidates in number order."""
    d = Path(archive_dir)
    root = root or d
    digits = "".join(ch for ch in d.name if ch.isdigit())
    cands = [read_candidate(c, root) for c in _folders(d) if c.name.startswith("cand_")]
    return dict(name=d.name, cycle=int(digits) if digits else None, dir=str(d),
                rules=as_dict(read_json(d / "rules.json", root=root)), iterations=read_jsonl(d / "iterations.jsonl", root=root),
                summary=read_jsonl(d / "summary.jsonl", root=root), frontier=as_dict(read_json(d / "frontier.json", root=root)),
                candidates=sorted(cands, key=lambda c: c["num"]))


def read_run(run_dir):
    """Everything the page needs from a run directory; a missing file gives None or []. The run
    is someone else's (jail/received.py): no symbolic link in it is followed, every file is
    capped, and a file that cannot be read is a BadRun naming it."""
    d = Path(run_dir)
    try:
        record = Path(unpacked_run(d))  # the run directory, or a temporary copy of a committed run's run.zip
        archive = unpacked_archive(d)
    except ValueError as e:
        raise BadRun(str(e)) from None
    archive = Path(archive) if archive else d / "archive"
    archive_root = archive.parent if archive == record / "archive" or archive == d / "archive" else archive
    phases = ([read_phase(p, archive_root) for p in _folders(archive)]
              if archive.is_dir() and not archive.is_symlink() else [])
    harness_dir = record / "harnesses"
    harnesses = ({p.name: read_text(p, "", root=record) for p in sorted(harness_dir.glob("*.py")) if not p.is_symlink()}
                 if harness_dir.is_dir() and not harness_dir.is_symlink() else {})
    return dict(dir=str(d), name=d.name, record=str(record), config=as_dict(read_json(record / "config.json", root=record)),
                summary=read_json(record / "summary.json", root=record), metrics=read_jsonl(record / "metrics.jsonl", root=record),
                state=read_json(d / "checkpoint" / "state.json", root=d), harnesses=harnesses, phases=phases)


def run_files_mtime(run_dir):
    """Newest modification time of the files a report is made from (to tell a stale report)."""
    d = Path(run_dir)
    paths = [d / "metrics.jsonl", d / "summary.json", d / "config.json", d / "checkpoint" / "state.json"]
    paths += list((d / "archive").glob("*/iterations.jsonl")) + list((d / "archive").glob("*/summary.jsonl"))
    paths += [d / "archive.zip", d / "run.zip"]
    return max([p.stat().st_mtime for p in paths if p.exists()] + [0.0])


def is_run_dir(path):
    return any((Path(path) / name).exists() for name in ("metrics.jsonl", "config.json", "run.zip"))


def find_runs(grid_dir):
    """Run directories under grid_dir (not looking inside a run)."""
    runs = []
    for root, dirs, _ in os.walk(grid_dir):
        if is_run_dir(root):
            runs.append(Path(root))
            dirs[:] = []
        else:
            dirs[:] = sorted(x for x in dirs if not x.startswith("."))
    return sorted(runs)


def as_dict(x):
    return x if isinstance(x, dict) else {}
