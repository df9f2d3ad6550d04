"""Compare two folders of runs (tools/same_behaviour.sh): for each run, summary.json and
metrics.jsonl with what differs between any two runs of the same code left out (seconds, speeds,
dates, commits, paths). Prints what differs; exit 0 when nothing does. Both folders may come from
elsewhere, so their files are read as received ones (jail/received.py: bounded, no link followed);
a file that cannot be read is one line and exit 2.
    python tools/same_runs.py RUNS_BEFORE RUNS_AFTER"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tools/x.py` imports the repository's modules

from jail import received

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


def records(run: Path, root: Path):
    """{record name: its stable fields}: summary.json, and metrics.jsonl line by line (with how many
    lines did not parse, so a torn line is a difference, not an error)."""
    out = {"summary.json": stable(received.read_json(run / "summary.json", root=root))}
    rows, bad = received.read_jsonl(run / "metrics.jsonl", root=root)
    for i, row in enumerate(rows):
        out[f"metrics.jsonl:{i + 1}"] = stable(row)
    out["metrics.jsonl lines that are not JSON"] = {"count": bad}
    return out


def shown(text) -> str:
    """A name from a received file, safe to print (no terminal control characters)."""
    return "".join(c if c.isprintable() else "?" for c in str(text))


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
            print(shown(f"{run.name}: not finished in {after}"))
            differ += 1
            continue
        try:
            a, b = records(run, Path(before)), records(Path(after) / run.name, Path(after))
        except (OSError, ValueError) as e:
            return refuse(shown(f"{run.name}: {e}"))
        before_this = differ
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                differ += 1
                ka, kb = a.get(key), b.get(key)
                fields = (sorted(map(str, (k for k in set(ka) | set(kb) if ka.get(k) != kb.get(k))))
                          if isinstance(ka, dict) and isinstance(kb, dict) else ["(the whole record)"])
                print(shown(f"{run.name} {key}: {', '.join(fields)[:300]}"))
        print(shown(f"{run.name}: {len(a)} records, {'identical' if differ == before_this else 'see above'}"))
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
