"""Compare two folders of runs (tools/same_behaviour.sh): for each run, summary.json and
metrics.jsonl with what differs between any two runs of the same code left out (seconds, speeds,
dates, commits, paths). Prints what differs; exit 0 when nothing does.
    python tools/same_runs.py RUNS_BEFORE RUNS_AFTER"""
import json
import sys
from pathlib import Path

VOLATILE = ("seconds", "argv", "per_s", "_s", "time", "date", "commit", "mfu", "dir", "path", "out", "host", "peak", "rss",
            "t", "elapsed", "python", "torch", "version")


def stable(x):
    """x without its volatile fields (recursively)."""
    if isinstance(x, dict):
        return {k: stable(v) for k, v in x.items()
                if not any(k == v_ or k.endswith(v_) or k.startswith(v_ + "_") for v_ in VOLATILE)}
    if isinstance(x, list):
        return [stable(v) for v in x]
    return x


def records(run: Path):
    out = {"summary.json": stable(json.loads((run / "summary.json").read_text()))}
    for i, line in enumerate((run / "metrics.jsonl").read_text().splitlines()):
        out[f"metrics.jsonl:{i + 1}"] = stable(json.loads(line))
    return out


def refuse(why: str) -> int:
    print(f"same_runs.py: {why}", file=sys.stderr)
    return 2


def main(before: str, after: str) -> int:
    differ = 0
    for folder in (before, after):
        if not Path(folder).is_dir():
            return refuse(f"{folder}: no such folder of runs")
    runs = sorted(p for p in Path(before).iterdir() if (p / "summary.json").exists())
    if not runs:
        return refuse(f"{before}: no finished run (a folder with summary.json) in it")
    for run in runs:
        if not (Path(after) / run.name / "summary.json").exists():
            print(f"{run.name}: not finished in {after}")
            differ += 1
            continue
        a, b = records(run), records(Path(after) / run.name)
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                differ += 1
                ka, kb = a.get(key) or {}, b.get(key) or {}
                fields = sorted(k for k in set(ka) | set(kb) if ka.get(k) != kb.get(k))
                print(f"{run.name} {key}: {', '.join(fields)[:300]}")
        print(f"{run.name}: {len(a)} records, {'identical' if differ == 0 else 'see above'}")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
