"""
Why FST's prompt-only search accepted nothing (issue 71 item 3), read from the committed run files
of the claim grid (results/runs/cpu-claim): for each FST cell, each harness phase's incoming
harness on the search set, what its failures were (harness_search.primitives.failure_signatures:
the same names the proposer reads), every prompt candidate by axis with the questions it won and
lost against the incumbent, and then FST's RSFT steps beside weight-only's at the same seed.

    python results/three-domains/fst_search.py > results/three-domains/fst-search.txt

Reads only; nothing is scored again. Left out: the whale cells' code-level searches (their report.html
cards show them).
"""
import json
import os
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from harness_search.harness_archive import read_jsonl, unpacked_run  # noqa: E402
from harness_search.primitives import failure_signatures  # noqa: E402

GRID = ROOT / "results" / "runs" / "cpu-claim"


def candidates(phase: Path):
    """{name: scores.json} of one harness phase's archive, and the incoming harness's traces."""
    out = {}
    for d in sorted(p for p in phase.iterdir() if p.is_dir() and p.name.startswith("cand_")):
        if (d / "scores.json").exists():
            out[d.name] = json.loads((d / "scores.json").read_text())
    return out, list(read_jsonl(phase / "cand_000" / "traces.jsonl"))


def steps(run: Path):
    return [(r["kept"], round(r["train_reward"], 4)) for r in read_jsonl(run / "metrics.jsonl")
            if r.get("event") == "rollout_step"]


def main():
    for domain in ("searchqa", "math"):
        for seed in (0, 1, 2):
            fst = Path(unpacked_run(str(GRID / f"{domain}-fst-s{seed}")))
            print(f"## {domain} FST seed {seed}")
            for phase in sorted((fst / "archive").glob("phase*/")):
                cands, incoming = candidates(phase)
                inc = cands.pop("cand_000")
                fails = failure_signatures(incoming)
                print(f"  {phase.name}: incoming harness {inc['success']:.3f} on {inc['n']} questions x "
                      f"{inc['rollouts'] // inc['n']}; its failures: "
                      + ", ".join(f"{k} {v}" for k, v in fails.most_common()))
                by_q = dict(zip(inc["example_ids"], inc["per_example"]))
                for name, s in cands.items():
                    theirs = dict(zip(s["example_ids"], s["per_example"]))
                    won = sum(theirs[q] > by_q[q] for q in theirs if q in by_q)
                    lost = sum(theirs[q] < by_q[q] for q in theirs if q in by_q)
                    print(f"    {name} {s.get('axis') or '-':<14} {s['success']:.3f}  questions won {won}, lost {lost}")
                axes = Counter(s.get("axis") for s in cands.values())
                print(f"    {len(cands)} candidates ({', '.join(f'{a} {n}' for a, n in axes.items())}); "
                      f"the best {max((s['success'] for s in cands.values()), default=0):.3f}")
            weight = Path(unpacked_run(str(GRID / f"{domain}-weight-only-s{seed}")))
            a, b = steps(fst), steps(weight)
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"  RSFT steps: FST {len(a)}, weight-only {len(b)}; the first {same} the same step for step "
                  f"(kept rollouts and training reward)\n")


if __name__ == "__main__":
    main()
