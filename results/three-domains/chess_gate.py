"""Stage 3's gate (README.md): how often a chess harness solves weight-pool puzzles with the base
model, the data phase A would roll out on (the weight pool; never the test split).

    python results/three-domains/chess_gate.py HARNESS.py [HARNESS.py ...] [--limit 100] [--n 4] [--out F.json]

Each harness is scored on weight[:limit] x n at whale.py's sampling (its Args: T, top-k, top-p, token cap,
seed 0) through rollout.evaluate, the path training and evaluation share. Prints per harness: mean@n +- SE,
the share of mate-in-1 and mate-in-2 puzzles solved, and the puzzles with at least one success (what
phase A could keep); --out writes the same as JSON."""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's modules
import whale  # noqa: E402 (first: the process settings a run has)
import rollout  # noqa: E402
from domains import chess  # noqa: E402
from lm import engine  # noqa: E402


def gate(source: str, eng, puzzles: list, n: int, args: whale.Args) -> dict:
    res = rollout.evaluate(eng, chess, source, puzzles, n, seed=args.seed, max_tokens=args.max_tokens,
                           sampling={"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p})
    means = rollout.per_example_means(res["records"])
    kinds = {p["id"]: p["task"]["plies"] for p in puzzles}
    by_kind = {k: [m for i, m in means.items() if kinds[i] == k] for k in (1, 3)}
    return {"mean": res["mean"], "se": res["se"], "n": n, "puzzles": len(puzzles), "seconds": round(res["seconds"], 1),
            "mate_in_1": sum(by_kind[1]) / max(1, len(by_kind[1])), "mate_in_2": sum(by_kind[3]) / max(1, len(by_kind[3])),
            "puzzles_with_a_success": sum(m > 0 for m in means.values()),
            "errors": res["errors"], "mean_turns": sum(r["turns"] for r in res["records"]) / max(1, len(res["records"]))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("harnesses", nargs="+", help="harness files (domains/chess_h0.py, a run's harnesses/cycle00.py)")
    ap.add_argument("--limit", type=int, default=100, help="the first N weight-pool puzzles")
    ap.add_argument("--n", type=int, default=4, help="samples per puzzle")
    ap.add_argument("--out", default="", help="also write the results here as JSON")
    a = ap.parse_args()
    missing = [h for h in a.harnesses if not Path(h).is_file()]
    if missing or a.limit < 1 or a.n < 1:
        sys.exit(f"chess_gate.py: {'no such file: ' + missing[0] if missing else '--limit and --n must be >= 1'}")
    args = whale.Args(domain="chess")
    eng = engine.load_engine(args.model)
    puzzles = chess.load_split("weight")[:a.limit]
    out = {}
    for h in a.harnesses:
        out[h] = gate(Path(h).read_text(), eng, puzzles, a.n, args)
        r = out[h]
        print(f"{h}: weight[:{a.limit}] mean@{a.n} {r['mean']:.4f} +- {r['se']:.4f}  mate in 1 {r['mate_in_1']:.3f}  "
              f"mate in 2 {r['mate_in_2']:.3f}  puzzles with a success {r['puzzles_with_a_success']}  "
              f"turns {r['mean_turns']:.2f}  errors {r['errors']}  {r['seconds']:.0f} s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
