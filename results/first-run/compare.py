"""Two runs' scores on the same questions, paired: mean@k of each, the per-question difference
(B - A) with its SE, and whether it is within one SE of 0 (results/first-run/README.md, rule 2).
    python results/first-run/compare.py RUN_A RUN_B"""
import json
import math
import sys
from pathlib import Path


def per_question(run: str) -> dict:
    """{question: mean@k} of the run's last test-split evaluation (metrics.jsonl)."""
    evals = [e for e in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())
             if e.get("event") == "eval" and e.get("split") == "test"]
    return evals[-1]["per_example"]


def main(a: str, b: str) -> int:
    pa, pb = per_question(a), per_question(b)
    if set(pa) != set(pb):
        sys.exit("compare.py: the two runs scored different questions")
    d = [pb[q] - pa[q] for q in pa]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else float("nan")
    print(f"A {a}: {sum(pa.values()) / len(pa):.4f}   B {b}: {sum(pb.values()) / len(pb):.4f}   "
          f"B - A {mean:+.4f} +- {se:.4f} (paired SE, {len(d)} questions, {sum(x != 0 for x in d)} differ): "
          f"{'within' if abs(mean) <= se else 'outside'} one SE")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
