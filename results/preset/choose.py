"""Apply the rules of results/preset/README.md to the runs under results/preset/runs.

    python results/preset/choose.py                # every stage's numbers and decisions
    python results/preset/choose.py --temperature  # only the temperature of step 2 (for run.sh)
    python results/preset/choose.py --lr           # only the best learning rate of step 3 (for run.sh)
    python results/preset/choose.py --learns       # yes/no: does a step-3 setting learn (for run.sh)

All numbers are validation numbers: the runs used --test-split val, so their "test" evaluations
are the 100 validation questions x 8 samples. Paired SEs are over the same questions.
"""
import json
import math
import sys
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "runs"
TEMPERATURES = ("0.3", "0.5", "0.7", "1.0")
LRS = {"base": "3e-4", "lr1e-3": "1e-3", "lr1e-4": "1e-4", "lr3e-5": "3e-5"}  # step 3, then (amendment) at the best lr:
OTHERS = ("layers8", "kept4")                                                 # --train-layers 8, --max-kept-per-prompt 4


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


def rsft_gain(name):
    """(gain, SE, steps, kept, optimizer steps, train reward) of a finished phase-A-alone run, or None."""
    if not finished(name):
        return None
    e = evals(name)
    m, se = paired(e["initial"]["per_example"], e["final"]["per_example"])
    steps = [json.loads(x) for x in (RUNS / name / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("event") == "rollout_step"]
    return dict(gain=m, se=se, initial=e["initial"]["mean"], final=e["final"]["mean"], steps=len(steps),
                kept=sum(s["kept"] for s in steps), opt=sum(s["opt_steps"] for s in steps),
                reward=sum(s["train_reward"] for s in steps) / max(len(steps), 1))


def best_lr(t):
    """The learning rate of step 3 with the largest val gain (all four must be finished)."""
    gains = {lr: rsft_gain(f"rsft-{cfg}-t{t}") for cfg, lr in LRS.items()}
    if None in gains.values():
        raise SystemExit("choose.py: the four learning-rate runs of step 3 are not all finished")
    return max(gains, key=lambda lr: gains[lr]["gain"])


def step3_rows(t):
    """[(gain, SE, name)] of the finished phase-A-alone runs of step 3 at temperature t."""
    names = [f"rsft-{cfg}-t{t}" for cfg in LRS]
    if all(finished(n) for n in names):
        names += [f"rsft-{cfg}-lr{best_lr(t)}-t{t}" for cfg in OTHERS]
    return [(g["gain"], g["se"], n) for n in names if (g := rsft_gain(n))]


def learns(m, se):
    return m > 1.96 * se


GRID = dict(lr="3e-4", train_layers=4, max_kept_per_prompt=2)  # the cpu grid's phase-A settings (run_all.sh)


def preset(rows, t):
    """(flags for run_all.sh cpu-long, the run they come from or None). The rule written before the
    runs: the largest val gain wins if it is above 1.96 SE; if no run learns, the grid's settings stay."""
    winners = [r for r in rows if learns(r[0], r[1])]
    if not winners:
        return dict(temperature=t, **GRID), None
    name = max(winners)[2]
    c = json.loads((RUNS / name / "config.json").read_text())
    return dict(temperature=c["temperature"], lr=c["lr"], train_layers=c["train_layers"],
                max_kept_per_prompt=c["max_kept_per_prompt"]), name


def preset_line(rows, t):
    flags, name = preset(rows, t)
    why = (f"from {name}, the largest val gain above 1.96 SE" if name else
           "no configuration's val gain is above 1.96 SE: phase A does not measurably learn at this "
           "scale, and the grid's settings stay")
    return f"preset for cpu-long: {' '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in flags.items())} ({why})"


def main():
    if sys.argv[1:] == ["--learns"]:
        rows = step3_rows(temperature()[0])
        if len(rows) < len(LRS) + len(OTHERS):
            raise SystemExit("choose.py: step 3 is not finished")
        print("yes" if any(learns(m, se) for m, se, _ in rows) else "no")
        return
    if sys.argv[1:] == ["--temperature"]:
        print(temperature()[0])
        return
    if sys.argv[1:] == ["--lr"]:
        print(best_lr(temperature()[0]))
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
        names = [f"rsft-{cfg}-t{t}" for cfg in LRS]
        lr = best_lr(t) if all(finished(n) for n in names) else None
        if lr:
            names += [f"rsft-{cfg}-lr{lr}-t{t}" for cfg in OTHERS]
            names += [f"rsft-kept4-lr{lr}-t0.7"]  # the second amendment's run
        rows = []
        for name in names:
            g = rsft_gain(name)
            if g is None:
                continue
            rows.append((g["gain"], g["se"], name))
            print(f"3. {name}: val mean@8 {100 * g['initial']:.1f} -> {100 * g['final']:.1f}, gain "
                  f"{100 * g['gain']:+.1f} +- {100 * g['se']:.1f} SE; {g['steps']} steps, train reward "
                  f"{100 * g['reward']:.1f}%, kept {g['kept']}, optimizer steps {g['opt']}")
        if lr:
            print(f"   best learning rate of the four: {lr}")
        step3_done = len(rows) >= len(LRS) + len(OTHERS)
        if step3_done and (any(learns(m, se) for m, se, _ in rows) or finished(f"rsft-kept4-lr{lr}-t0.7")):
            print("   " + preset_line(rows, t))

if __name__ == "__main__":
    main()
