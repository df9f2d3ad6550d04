"""
Where a run's minutes went, from its metrics.jsonl, and the same run on the developers' machine of
issue 68 (by its yardstick: the unchanged initial test, h0 on 100 questions x 8, took 90.8 s there):

    python results/first-run/minutes.py results/runs/default/searchqa-whale-s0   # a run, or its run.zip
    python results/first-run/minutes.py /tmp/whale-run-24/searchqa-whale-s0

Prints the initial test, each phase (rundir/phases.py's seconds: its steps or its search, not the
validation after it), the final test, the 2 x 2's cells, the whole (metrics.jsonl's clock: from the
process start to the last line, so the imports and the model load before it are not in it, nor the
report after it), the machine's fp32 matmul figure the run recorded, and the whole scaled by
90.8 / (this run's initial test seconds).
The scaling is a yardstick, not a model: the same work at another machine's speed, measured by the one
evaluation every default run repeats unchanged. The run is read as someone else's files
(rundir/run_reader.py: no link followed, sizes capped; a bad one is one line, exit 2). Left out: runs
without an initial test line (--method eval); a cached initial evaluation counts the first run's seconds.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's rundir/

from rundir.phases import phases  # noqa: E402
from rundir.run_reader import BadRun, read_run  # noqa: E402  (a committed run is a run.zip)

DEVELOPERS_INITIAL_TEST_S = 90.8  # issue 68: the initial test evaluation on the developers' machine


def minutes(run) -> list[tuple[str, float]]:
    """[(part, seconds)] of a run (run_reader.read_run's dict) in the run's order, the whole last."""
    rows = run["metrics"]
    tests = {r["tag"]: r["seconds"] for r in rows if r.get("event") == "eval" and r.get("split") == "test"}
    parts = [("initial test", tests["initial"])]
    parts += [(f"phase {p['phase']}{p['cycle']}", p["seconds"]) for p in phases(run["record"])]
    parts += [(f"{tag} test", s) for tag, s in tests.items() if tag != "initial"]
    parts += [(f"2 x 2: {r['cell'].replace('_', ' ')}", r["seconds"]) for r in rows if r.get("event") == "two_by_two"]
    return parts + [("whole (metrics.jsonl's clock)", rows[-1]["t"])]


def main(argv) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        run = read_run(argv[0])
        parts = minutes(run)
    except (BadRun, OSError, KeyError, IndexError, TypeError) as e:
        print(f"minutes.py: error: {argv[0]}: not a run with an initial test ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    for name, s in parts:
        print(f"{name:<48} {s:8.1f} s  {s / 60:5.1f} min")
    whole, initial = parts[-1][1], parts[0][1]
    cells = sum(s for name, s in parts if name.startswith("2 x 2"))
    scale = DEVELOPERS_INITIAL_TEST_S / initial / 60
    print(f"machine: {(run['summary'] or {}).get('matmul_gflop_per_s')} fp32 matmul GFLOP/s (summary.json)")
    print(f"on the developers' machine (x {DEVELOPERS_INITIAL_TEST_S} / {initial:.1f} s): {whole * scale:.1f} min; "
          f"without the 2 x 2's cells {(whole - cells) * scale:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
