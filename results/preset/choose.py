"""Apply the rules of results/preset/README.md to the runs under results/preset/runs.

    python results/preset/choose.py                # every stage's numbers and decisions
    python results/preset/choose.py --temperature  # only the temperature of step 2 (for run.sh)

All numbers are validation numbers: the runs used --test-split val, so their "test" evaluations
are the 100 validation questions x 8 samples. Paired SEs are over the same questions.
"""
import json
import math
import sys
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "runs"
TEMPERATURES = ("0.3", "0.5", "0.7", "1.0")
RSFT = ("base", "lr1e-3", "lr1e-4", "layers8", "kept4")


def evals(name):
    """{tag: eval row} of a finished run's 'test' (= validation) evaluations."""
    rows = [json.loads(x) for x in (RUNS / name / "metrics.jsonl").read_text().splitlines()]
    return {r["tag"]: r for r in rows if r.get("event") == "eval" and r["split"] == "test"}


def paired(a, b):
    """mean and SE over questions of b - a (per-question mean@8 dicts)."""
    d = [b[k] - a[k] for k in a if k in b]
    m = sum(d) / len(d)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1))
    return m, sd / math.sqrt(len(d))


def finished(name):
    return (RUNS / name / "summary.json").exists()


def temperature():
    scores = {t: evals(f"eval-t{t}")["initial"] for t in TEMPERATURES}
    best = max(TEMPERATURES, key=lambda t: scores[t]["mean"])
    ok = [t for t in TEMPERATURES
          if t == best or scores[best]["mean"] - scores[t]["mean"] <= paired(scores[t]["per_example"],
                                                                            scores[best]["per_example"])[1]]
    return max(ok, key=float), scores, best


def main():
    if sys.argv[1:] == ["--temperature"]:
        print(temperature()[0])
        return
    if finished("search"):
        e = evals("search")
        m, se = paired(e["initial"]["per_example"], e["final"]["per_example"])
        print(f"1. harness search: val mean@8 h0 {100 * e['initial']['mean']:.1f}, H* {100 * e['final']['mean']:.1f} "
              f"(paired gain {100 * m:+.1f} +- {100 * se:.1f} SE)")
    if all(finished(f"eval-t{t}") for t in TEMPERATURES):
        t, scores, best = temperature()
        for x in TEMPERATURES:
            d = "" if x == best else " (%+.1f +- %.1f SE vs T=%s)" % tuple(
                [100 * v for v in paired(scores[best]["per_example"], scores[x]["per_example"])] + [best])
            print(f"2. T={x}: H* val mean@8 {100 * scores[x]['mean']:.1f} +- {100 * scores[x]['se']:.1f}{d}")
        print(f"   chosen temperature: {t}")
        rows = []
        for cfg in RSFT:
            name = f"rsft-{cfg}-t{t}"
            if not finished(name):
                continue
            e = evals(name)
            m, se = paired(e["initial"]["per_example"], e["final"]["per_example"])
            steps = [json.loads(x) for x in (RUNS / name / "metrics.jsonl").read_text().splitlines()]
            steps = [s for s in steps if s.get("event") == "rollout_step"]
            kept = sum(s["kept"] for s in steps)
            opt = sum(s["opt_steps"] for s in steps)
            rows.append((m, se, cfg))
            print(f"3. {name}: val mean@8 {100 * e['initial']['mean']:.1f} -> {100 * e['final']['mean']:.1f}, "
                  f"gain {100 * m:+.1f} +- {100 * se:.1f} SE; {len(steps)} steps, train reward "
                  f"{100 * sum(s['train_reward'] for s in steps) / max(len(steps), 1):.1f}%, kept {kept}, "
                  f"optimizer steps {opt}")
        if len(rows) == len(RSFT):
            m, se, cfg = max(rows)
            print(f"   chosen phase-A settings: {cfg} (gain {100 * m:+.1f} +- {100 * se:.1f} SE: "
                  f"{'measurable' if m > 1.96 * se else 'NOT measurable'} at 1.96 SE)")


if __name__ == "__main__":
    main()
