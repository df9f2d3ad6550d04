"""
Stage 2's decision rule (results/three-domains/README.md, written before the selection runs): the
adaptive setting, A or B, with the higher mean over search QA and math of the final validation
mean@8 of its selection run (results/runs/three-domains-select/<domain>-whale-adaptive-<A|B>-s0,
whose final evaluation was on validation); a difference under 0.5 points is a tie, and a tie keeps
A. Prints the four numbers and writes the letter to adaptive-choice.txt, which run.sh's
<domain>-whale-adaptive-s<seed> cells read.

    python results/three-domains/adaptive_choice.py
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
from tools import results  # noqa: E402  (the repository's own reader of packed runs)

DOMAINS, SETTINGS, TIE = ("searchqa", "math"), ("A", "B"), 0.5


def main():
    runs = {r["dir"].name: r for r in results.load(ROOT / "results" / "runs" / "three-domains-select")}
    score = {}
    for k in SETTINGS:
        vals = []
        for d in DOMAINS:
            r = runs.get(f"{d}-whale-adaptive-{k}-s0")
            if r is None:
                raise SystemExit(f"adaptive_choice.py: the selection run {d}-whale-adaptive-{k}-s0 has not landed yet")
            if r["cfg"].get("test_split") != "val":
                raise SystemExit(f"adaptive_choice.py: {d}-whale-adaptive-{k}-s0 was evaluated on "
                                 f"{r['cfg'].get('test_split')}, not validation")
            vals.append(100 * r["sum"]["test_mean8_final"])
            print(f"{k} {d}: final validation mean@8 {vals[-1]:.1f} %")
        score[k] = sum(vals) / len(vals)
        print(f"{k}: mean over the two domains {score[k]:.2f} %")
    choice = "B" if score["B"] - score["A"] >= TIE else "A"
    why = "B is higher by at least 0.5 points" if choice == "B" else \
        "A is higher" if score["A"] > score["B"] else "a tie (under 0.5 points) keeps A"
    print(f"choice: {choice} ({why})")
    (HERE / "adaptive-choice.txt").write_text(choice + "\n")


if __name__ == "__main__":
    main()
