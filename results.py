"""
Tables and curves from finished runs: results/RESULTS.md and results/curve_<domain>.png.

    python results.py results/runs/cpu --out results

Reads every <run>/summary.json (+ config.json, metrics.jsonl) below the given folder and
reports, per domain and method, the mean over seeds with a 95% confidence interval
(Student t over seeds; with one seed only the mean) of the final test mean@8, the test
mean@8 of the checkpoint chosen on validation, and, labelled, the paper's best-on-test
number. Nothing is typed in by hand: every number comes from the summaries.

Below the table, the paper's claims as head-to-head comparisons: method A's final test
mean@8 minus method B's on the same test questions, per seed paired over questions (the
question-to-question spread cancels); with one seed that difference ± its SE, with several
the mean over seeds ± 95% CI. Each claim gets a comparison only where both cells exist.
"""
import argparse
import json
import math
import subprocess
from pathlib import Path

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def label(cfg):
    return cfg["method"] + ("-adaptive" if cfg["schedule"].startswith("adaptive") else "")


def mean_ci(xs):
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return m, T95.get(len(xs) - 1, 1.96) * sd / math.sqrt(len(xs))


def fmt(xs):
    m, ci = mean_ci([100 * x for x in xs])
    return f"{m:.1f}" if ci is None else f"{m:.1f} ± {ci:.1f}"


def load(root: Path):
    runs = []
    for s in sorted(root.glob("*/summary.json")):
        cfg = json.loads((s.parent / "config.json").read_text())
        metrics = [json.loads(x) for x in (s.parent / "metrics.jsonl").read_text().splitlines()]
        runs.append({"dir": s.parent, "cfg": cfg, "sum": json.loads(s.read_text()), "metrics": metrics})
    return runs


SEEDLESS = ("seed", "out", "resume", "device", "engine", "tp")  # what may differ between seeds of one cell


def cell_labels(runs):
    """Runs of one method with different settings are different cells: each label names the
    settings that differ between them (e.g. 'whale (lr=0.0001)'), so they are never averaged."""
    groups = {}
    for r in runs:
        groups.setdefault((r["cfg"]["domain"], label(r["cfg"])), []).append(r)
    for (d, m), rs in groups.items():
        keys = sorted({k for r in rs for k in r["cfg"] if k not in SEEDLESS
                       and len({json.dumps(x["cfg"].get(k)) for x in rs}) > 1})
        for r in rs:
            r["cell"] = (d, m + (" (" + ", ".join(f"{k}={r['cfg'].get(k)}" for k in keys) + ")" if keys else ""))


def table(runs):
    cell_labels(runs)
    cells = {}
    for r in runs:
        cells.setdefault(r["cell"], []).append(r)
    rows = ["| domain | method | seeds | test questions | test mean@8 final (%) | gain over initial (%) | "
            "best-on-val (%) | initial (%) | rollouts | proposer calls | minutes | best-on-test (%, selected on test) |",
            "|" + "---|" * 12]
    for (d, m), rs in sorted(cells.items()):
        g = lambda k: [x["sum"][k] for x in rs]
        gains = [x["sum"].get("test_gain") for x in rs]
        # one seed: the gain with the SE of its per-question differences; several: mean ± 95% CI
        if None in gains:  # a summary written before per-question scores were kept
            gain = "n/a"
        else:
            gain = fmt(gains) if len(rs) > 1 else f"{100 * gains[0]:+.1f} ± {100 * rs[0]['sum']['test_gain_se']:.1f} (SE)"
        rows.append(f"| {d} | {m} | {len(rs)} | {rs[0]['sum']['test_examples']} | {fmt(g('test_mean8_final'))} | "
                    f"{gain} | {fmt(g('test_mean8_best_val'))} | "
                    f"{fmt(g('test_mean8_initial'))} | {sum(g('rollouts')) / len(rs):.0f} | "
                    f"{sum(g('proposer_calls')) / len(rs):.0f} | {sum(g('seconds')) / len(rs) / 60:.1f} | "
                    f"{fmt(g('test_mean8_best_test'))} |")
    return "\n".join(rows)


# the paper's claims as (A, B, what A > B would mean); every row also shows rollouts and minutes
CLAIMS = [("whale", "weight-only", "joint beats weights alone"),
          ("whale", "harness-only", "joint beats the harness alone"),
          ("harness-only", "weight-only", "harness-only beats weight-only: the bottleneck is the harness"),
          ("whale", "stagewise", "alternating beats stagewise at equal rollouts"),
          ("whale", "fst", "code-level harness search beats prompt-only (FST)"),
          ("whale-adaptive", "whale", "adaptive switching vs the fixed schedule")]


def final_per_question(run):
    """{question id: mean score} of the run's final test evaluation (metrics.jsonl)."""
    finals = [m for m in run["metrics"] if m.get("event") == "eval" and m["split"] == "test"
              and m.get("tag") == "final" and "per_example" in m]
    return finals[-1]["per_example"] if finals else None


def claims(runs):
    """One row per claim and domain where both cells have runs of the same seeds."""
    from rollout import paired_gain  # the same paired statistics as a run's own gain
    cells = {}
    for r in runs:
        cells.setdefault(r["cell"], {})[r["cfg"]["seed"]] = r
    rows = ["| domain | A | B | claim (A > B) | seeds | A - B, final test mean@8 (points) | rollouts A / B | minutes A / B |",
            "|" + "---|" * 8]
    for d in sorted({c[0] for c in cells}):
        for ma, mb, what in CLAIMS:
            A, B = cells.get((d, ma), {}), cells.get((d, mb), {})
            seeds = sorted(set(A) & set(B))
            diffs = []
            for s in seeds:
                a, b = final_per_question(A[s]), final_per_question(B[s])
                if a and b:
                    diffs.append((*paired_gain(b, a), len(set(a) & set(b))))  # A - B
            if not diffs:
                continue
            if len(diffs) == 1:
                m, se, n = diffs[0]
                diff = f"{100 * m:+.1f} ± {100 * se:.1f} (SE, {n} questions, {m / se if se else 0:.1f} SE)"
            else:
                m, ci = mean_ci([100 * x[0] for x in diffs])
                diff = f"{m:+.1f} ± {ci:.1f} (95% CI over seeds)"
            avg = lambda cell, k: sum(cell[s]["sum"][k] for s in seeds) / len(seeds)
            rows.append(f"| {d} | {ma} | {mb} | {what} | {len(diffs)} | {diff} | {avg(A, 'rollouts'):.0f} / "
                        f"{avg(B, 'rollouts'):.0f} | {avg(A, 'seconds') / 60:.1f} / {avg(B, 'seconds') / 60:.1f} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def curves(runs, out: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    for d in sorted({r["cfg"]["domain"] for r in runs}):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        by_method = {}
        for r in runs:
            if r["cfg"]["domain"] != d:
                continue
            pts = [(m["rollouts"], m["mean"]) for m in r["metrics"] if m.get("event") == "eval"
                   and m["split"] in ("test", "test_subset") and m.get("tag") != "best_val"]
            by_method.setdefault(r["cell"][1], []).append(pts)
        for m, seeds in sorted(by_method.items()):
            xs = sorted({x for pts in seeds for x, _ in pts})
            ys = [sum(dict(p).get(x, p[-1][1]) for p in seeds) / len(seeds) for x in xs]
            ax.plot(xs, [100 * y for y in ys], marker="o", label=m)
        ax.set(xlabel="cumulative target rollouts", ylabel="test mean@8 (%)", title=f"{d} (mean over seeds)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"curve_{d}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path)
    return made


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root", help="folder holding run directories")
    ap.add_argument("--out", default="results", help="where RESULTS.md and the curves go")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = load(Path(a.root))
    if not runs:
        raise SystemExit(f"results.py: no finished runs (summary.json) under {a.root}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cell_labels(runs)
    pngs, head_to_head = curves(runs, out), claims(runs)
    text = (f"# Results\n\nGenerated by `python results.py {a.root} --out {a.out}` at commit {commit} from "
            f"{len(runs)} finished runs. Mean over seeds ± 95% CI (t). 'final' = the last checkpoint; "
            "'best-on-val' = the checkpoint chosen on the validation split, scored on test; "
            "'best-on-test' is the paper's metric, selected on the test split itself.\n\n" + table(runs) + "\n\n"
            + ("## The paper's claims, head to head\n\n" + head_to_head + "\n\n" if head_to_head else "")
            + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n")
    (out / "RESULTS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
