"""
Would the default run's last test evaluations be cheaper in shared batches? The final test and the
2 x 2's (final weights, h0) cell are two test-sized evaluations on the same weights, so they could
sample in one engine (rollout.in_shared_batches, as phase B's candidates do). This measures that on
the base weights: searchqa h0 and the committed default run's final harness (run 22's), 100 test
questions x 8 each at the run's sampling settings and seeds, one after the other, then shared.

    python results/first-run/shared_tests.py            # ~7 min alone on 2 cores

Prints each evaluation's seconds and mean@8, the shared pair's seconds, their ratio, and whether
every evaluation sampled the same tokens both ways. Left out: the run's --max-memory cap (the
engine's own batch limits apply: this process peaks above 4 GB), the trained weights (not
committed), the (base weights, final harness) cell (nothing else runs on the base weights then).
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's modules
from lm.process_tuning import tune_process  # noqa: E402

tune_process()  # (as whale.py: before torch loads)
import rollout  # noqa: E402
from domains import searchqa  # noqa: E402
from lm.engine import load_engine  # noqa: E402
from rundir.run_reader import read_run  # noqa: E402
from whale import Args  # noqa: E402  (the default run's settings)

RUN = Path(__file__).resolve().parents[1] / "runs" / "default" / "searchqa-whale-s0"


def main() -> int:
    args = Args()
    engine = load_engine("embedded", seed=args.seed)
    test = searchqa.load_split("test")[:args.test_limit]
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    harnesses = {"h0": Path(searchqa.H0).read_text(), "final": read_run(RUN)["harnesses"]["cycle00.py"]}

    def evaluation(source):  # what evaluation.measure runs for a test evaluation
        return lambda: rollout.evaluate(engine, searchqa, source, test, args.test_n, seed=(args.seed, "test"),
                                        sampling=sampling, max_tokens=args.max_tokens)

    t = time.time()
    alone = [evaluation(src)() for src in harnesses.values()]
    alone_s = time.time() - t
    for name, r in zip(harnesses, alone):
        print(f"{name:<6} alone {r['seconds']:7.1f} s  mean@{args.test_n} {r['mean']:.4f}", flush=True)
    t = time.time()
    shared = rollout.in_shared_batches(engine, [evaluation(src) for src in harnesses.values()])
    shared_s = time.time() - t
    same = all(a["records"] and [x["calls"][i]["completion_ids"] for x in a["records"] for i in range(len(x["calls"]))]
               == [x["calls"][i]["completion_ids"] for x in b["records"] for i in range(len(x["calls"]))]
               for a, b in zip(alone, shared))
    print(f"one after the other {alone_s:.1f} s, shared {shared_s:.1f} s: {alone_s / shared_s:.2f}x; "
          f"the same tokens: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
