"""
The table of issue #32's phase-A study, from the runs' own files (never typed by hand).

    python results/phase-a/study.py results/phase-a/runs                 # print the table
    python results/phase-a/study.py results/phase-a/runs --readme results/phase-a/README.md
    python results/phase-a/study.py results/phase-a/runs --best          # stage 1's best regime (for R7/R8)
    python results/phase-a/study.py results/phase-a/runs --confirm       # the regime the seed-1 rerun repeats
    python results/phase-a/study.py results/phase-a/runs --best --math   # the same for math's M1-M7 (M7, MC1)

Per regime (a run directory results/phase-a/runs/R<k>): what phase A had to learn from (kept
rollouts and trained tokens per RSFT step), the health figure (share of replies at the token cap),
the val curve (val[:32] x 2 every 16 steps), the final paired val gain +- SE on all 100 val
questions x 8 (the runs' "test" is val: --test-split val), the rule's verdict and the minutes the
run took (wall clock of one process on this 2-core machine, shared with at most one other run).
The rule (README, fixed before the runs): a regime learns when its gain is above 1.96 SE.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's tools/
from tools.results import into_readme  # noqa: E402

STAGE1 = ("R1", "R2", "R3", "R4", "R5", "R6")
# math's study (item 2) is the same regimes from math's h0, named M<k>; it has no R8 (no H_s in math)
MATH_STAGE1 = tuple("M" + k[1:] for k in STAGE1)


def load(root: Path) -> dict:
    runs = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.json").exists()):
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else None
        runs[d.name] = {"config": json.loads((d / "config.json").read_text()), "summary": summary,
                        "steps": [r for r in rows if r.get("event") == "rollout_step"],
                        "val": [r for r in rows if r.get("event") == "eval" and r.get("split") == "val"]}
    return runs


def learns(s) -> bool:
    return s["test_gain"] > 1.96 * s["test_gain_se"]


def verdict(name, s) -> str:
    """The rule's word for a finished run: a regime learns above 1.96 SE; the seed-1 rerun C1
    confirms it when its own gain is positive and above 1 SE."""
    if name in ("C1", "MC1"):
        return "**confirmed**" if s["test_gain"] > s["test_gain_se"] else "not confirmed"
    return "**learns**" if learns(s) else "no"


def best_stage1(runs, stage1=STAGE1) -> str:
    """R7 and R8 (math: M7) take the settings of the stage-1 regime with the largest val gain. R3
    is not a candidate (amendment 2026-12-02): 64 of its 4x larger steps (~9 h) cannot finish in a sitting."""
    done = {k: r["summary"] for k, r in runs.items() if k in stage1 and r["summary"]}
    missing = [k for k in stage1 if k not in done]
    if missing:
        raise SystemExit(f"study.py: stage 1 is not finished ({', '.join(missing)} missing): "
                         "the 64-step runs wait for it")
    return max((k for k in done if k[1:] != "3"), key=lambda k: done[k]["test_gain"])


def best_learning(runs, regimes=STAGE1 + ("R7", "R8")) -> str:
    """The regime the seed-1 confirmation reruns: the largest gain among those above 1.96 SE
    (R1-R8, or math's M1-M7, once all have finished), or '' when none learns."""
    done = {k: r["summary"] for k, r in runs.items() if k in regimes and r["summary"]}
    if len(done) < len(regimes):
        raise SystemExit(f"study.py: {regimes[0]}-{regimes[-1]} are not all finished: the seed-1 confirmation waits for them")
    learning = [k for k in done if learns(done[k])]
    return max(learning, key=lambda k: done[k]["test_gain"]) if learning else ""


def start_harness(config) -> str:
    h = config["harness"]
    return "h0" if not h or h.endswith("_h0.py") else "H_s"


def row(name, r) -> str:
    c, s, steps = r["config"], r["summary"], r["steps"]
    kept = [x["kept"] for x in steps]
    tokens = [x["trained_tokens"] for x in steps]
    capped = [x["capped_frac"] for x in steps if x.get("capped_frac") is not None]
    curve = " ".join(f"{v['mean']:.3f}" for v in r["val"])
    med = lambda xs: f"{statistics.median(xs):g}" if xs else "-"
    cells = [name, f"{c['domain']}, T {c['temperature']:g}, lr {c['lr']:g}, B {c['prompts_per_step']}, cap "
             f"{c['max_kept_per_prompt']}, K {c['train_layers']}, replay {c.get('replay_steps', 1)}x"
             f"{c.get('sft_epochs', 1)}, {start_harness(c)}" + (f", seed {c['seed']}" if c["seed"] else "")
             + (", shared prompts" if c.get("sft_prompts") == "shared" else ""),
             f"{len(steps)}", f"{med(kept)} ({sum(kept)})", f"{med(tokens)} ({sum(tokens)})",
             f"{max(capped):.0%}" if capped else "-", curve or "-"]
    if s is None:
        return "| " + " | ".join(cells + ["(running)", "", ""]) + " |"
    return "| " + " | ".join(cells + [
        f"{s['test_mean8_initial']:.3f} -> {s['test_mean8_final']:.3f}: {s['test_gain']:+.3f} ± {s['test_gain_se']:.3f}",
        verdict(name, s), f"{s['seconds'] / 60:.0f}"]) + " |"


def table(runs) -> str:
    head = ("| regime | settings | RSFT steps | kept per step: median (all) | trained tokens per step: median (all) "
            "| most replies at the cap in a step | val[:32] x 2 curve | val mean@8, 100 x 8: initial -> final: gain ± SE "
            "| verdict (> 1.96 SE; C1: > 1 SE) | minutes |\n" + "|---" * 10 + "|")
    lines = [head] + [row(k, r) for k, r in runs.items()]
    return "\n".join(lines) + "\n\n(`python results/phase-a/study.py results/phase-a/runs`)"


def main():
    p = argparse.ArgumentParser(description="the phase-A study's table")
    p.add_argument("root", type=Path)
    p.add_argument("--readme", type=Path, help="also write the table between this README's results.py markers")
    p.add_argument("--best", action="store_true", help="print stage 1's regime with the largest val gain")
    p.add_argument("--confirm", action="store_true", help="print the learning regime to rerun at seed 1 ('' if none)")
    p.add_argument("--math", action="store_true", help="--best / --confirm among math's regimes (M1-M6, M7)")
    a = p.parse_args()
    if not a.root.is_dir():
        raise SystemExit(f"study.py: no such folder {a.root}")
    runs = load(a.root)
    if a.best or a.confirm:
        if a.math:
            print(best_stage1(runs, MATH_STAGE1) if a.best else best_learning(runs, MATH_STAGE1 + ("M7",)))
        else:
            print(best_stage1(runs) if a.best else best_learning(runs))
        return
    text = table(runs)
    print(text)
    if a.readme:
        into_readme(a.readme, a.root, text)


if __name__ == "__main__":
    main()
