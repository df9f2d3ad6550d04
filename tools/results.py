"""
Tables and curves from finished runs: <root>/RESULTS.md and <root>/curve_<domain>.png beside the runs.

    python tools/results.py results/runs/cpu --out results/runs/cpu [--readme README.md]
    python tools/results.py results/runs/cpu --pack     # each finished run -> run.zip (+ report.html)

Reads every finished run's summary.json (+ config.json, metrics.jsonl; or its run.zip) below the given folder and
reports, per domain and method, the mean over seeds with a 95% confidence interval
(Student t over seeds; with one seed only the mean) of the final test mean@8, the test
mean@8 of the checkpoint chosen on validation, and, labelled, the paper's best-on-test
number. Nothing is typed in by hand: every number comes from the summaries, and --readme
writes the same text between two marker lines of the README.

Then:
  - the paper's claims as head-to-head comparisons: method A's final test mean@8 minus method
    B's on the same test questions, per seed paired over questions (the question-to-question
    spread cancels); one seed: that difference ± its SE, several: the mean over seeds ± the wider of
    the t interval over seeds and the interval over questions of the seed-averaged differences;
    a verdict (holds / reversed / unresolved at 95%) and where A's curve first reaches B's final;
  - where each run spent its rollouts: its phases in order (A11 B6 A5 ...) from metrics.jsonl;
  - the grid's coverage (which method x domain x seed cells finished, which runs to resume);
  - per run, the git commit(s) it ran at and the whale.py command that reproduces it;
  - one curve per domain: test mean@8 against cumulative target rollouts, every point of a
    run on the same questions (test[:test_subset]).
Leaves out: significance corrections across the many claims (read single rows with that in mind).
"""
import argparse
import functools
import importlib
import json
import math
import os
import subprocess
from pathlib import Path
import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tools/x.py` imports the repository's modules

ROOT = Path(__file__).resolve().parents[1]  # the repository root

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


def finished_runs(root: Path):
    """The finished runs under root (or root itself): a summary.json, or packed into run.zip."""
    own = [root] if (root / "summary.json").exists() or (root / "run.zip").exists() else []
    return own or sorted({p.parent for pattern in ("*/summary.json", "*/run.zip") for p in root.glob(pattern)})


def load(root: Path):
    """Every finished run under root. Runs are someone else's files (jail/received.py): no link
    followed, sizes capped; a file that cannot be read ends the table with one line naming it."""
    from harness_search import harness_archive
    from jail import received
    runs = []
    for d in finished_runs(root):
        try:
            record = Path(harness_archive.unpacked_run(d))  # the run itself, or its run.zip unpacked
            cfg, summary = (received.read_json(record / name, root=record) for name in ("config.json", "summary.json"))
            metrics, bad = received.read_jsonl(record / "metrics.jsonl", root=record)
            if not (isinstance(cfg, dict) and isinstance(summary, dict)) or bad:
                raise ValueError(f"{record}: config.json and summary.json must be JSON objects"
                                 + (f"; {bad} lines of metrics.jsonl are not" if bad else ""))
        except (OSError, ValueError) as e:
            raise SystemExit(f"results.py: {d}: {e}") from None
        runs.append({"dir": d, "record": record, "cfg": cfg, "sum": summary, "metrics": metrics})
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


def summary_table(runs):
    """The README's short table: final test mean@8 and gain per cell (RESULTS.md has the full one)."""
    cell_labels(runs)
    cells = {}
    for r in runs:
        cells.setdefault(r["cell"], []).append(r)
    rows = ["| domain | method | seeds | test mean@8 final (%) | gain over initial (points) | rollouts |",
            "|---|---|---|---|---|---|"]
    for (d, m), rs in sorted(cells.items()):
        gains = [x["sum"]["test_gain"] for x in rs]
        gain = fmt(gains) if len(rs) > 1 else f"{100 * gains[0]:+.1f} ± {100 * rs[0]['sum']['test_gain_se']:.1f} (SE)"
        rows.append(f"| {d} | {m} | {len(rs)} | {fmt([x['sum']['test_mean8_final'] for x in rs])} | {gain} | "
                    f"{spent(rs)} |")
    return "\n".join(rows)


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
                    f"{fmt(g('test_mean8_initial'))} | {spent(rs)} | "
                    f"{sum(g('proposer_calls')) / len(rs):.0f} | {sum(g('seconds')) / len(rs) / 60:.1f} | "
                    f"{fmt(g('test_mean8_best_test'))} |")
    return "\n".join(rows)


def spent(rs):
    """Target rollouts of a cell, 'spent / budget' where the runs spent less than their budget
    (a harness phase whose last full iteration did not fit: the stagewise runs of the cpu grid)."""
    got, budget = sum(r["sum"]["rollouts"] for r in rs) / len(rs), sum(r["cfg"]["budget"] for r in rs) / len(rs)
    return f"{got:.0f}" if got == budget else f"{got:.0f} of {budget:.0f}"


def diagnostics(runs):
    """What each side had to learn from, per cell (mean over seeds): phase A's RSFT steps, training
    reward, kept rollouts and trained (model-written) tokens per step and optimizer steps (from
    metrics.jsonl); phase B's proposed candidates, how many were valid, and accepted (from the
    run's archive, folder or packed)."""
    from harness_search import harness_archive
    cells = {}
    for r in runs:
        steps = [m for m in r["metrics"] if m.get("event") == "rollout_step"]
        c = {"steps": len(steps), "reward": [m["train_reward"] for m in steps], "kept": [m["kept"] for m in steps],
             "opt": sum(m.get("opt_steps", 0) for m in steps),
             "tokens": [m["trained_tokens"] for m in steps if "trained_tokens" in m],
             "proposed": 0, "valid": 0, "accepted": 0}
        archive = harness_archive.unpacked_archive(r["dir"])
        for phase in sorted(os.listdir(archive)) if archive else []:
            d = os.path.join(archive, phase)
            for cand in harness_archive.load_archive(d):
                if cand["num"] > 0:  # cand_000 is the incoming harness, not a proposal
                    c["proposed"] += 1
                    c["valid"] += cand["scores"] is not None
            c["accepted"] += sum(bool(line.get("accepted"))
                                  for line in harness_archive.read_jsonl(os.path.join(d, "iterations.jsonl")))
        cells.setdefault(r["cell"], []).append(c)
    rows = ["| domain | method | seeds | RSFT steps | train reward (%) | kept / step (min-max) | optimizer steps | "
            "trained tokens / step | candidates proposed | valid | accepted |", "|" + "---|" * 11]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    for (d, m), cs in sorted(cells.items()):
        kept = [k for c in cs for k in c["kept"]]
        tokens = [t for c in cs for t in c["tokens"]]
        per = lambda key: f"{mean([c[key] for c in cs]):.1f}".removesuffix(".0")
        reward = [x for c in cs for x in c["reward"]]
        rows.append(f"| {d} | {m} | {len(cs)} | {per('steps')} | " + (f"{100 * mean(reward):.1f}" if reward else "-") + " | "
                    + (f"{mean(kept):.1f} ({min(kept)}-{max(kept)})" if kept else "-") + f" | {per('opt')} | "
                    + (f"{mean(tokens):.0f}" if tokens else "-" if not kept else "not logged") + " | "
                    + f"{per('proposed')} | {per('valid')} | {per('accepted')} |")
    return "\n".join(rows)


def phases(run):
    """The phases a run went through, in order ('A11 B5 A5' = 11 RSFT steps, then 5 proposer
    iterations, then 5 RSFT steps; rundir/phases.py reads them from its metrics.jsonl), and the share
    of its target rollouts that went to harness phases (the rest trained the weights)."""
    from rundir.phases import phases as run_phases
    got = run_phases(run["record"])
    seq = " ".join(f"{p['phase']}{p['steps'] if p['phase'] == 'A' else p['iterations']}" for p in got)
    spent = lambda side: sum(p["rollouts_end"] - p["rollouts_start"] for p in got if p["phase"] == side)
    total = spent("A") + spent("B")
    return seq, (spent("B") / total if total else 0.0)


PHASES_NOTE = ("Each run's phases in order (A = RSFT steps, B = proposer iterations, not counting the "
               "re-scoring of the incoming harness that opens each harness phase), and the share of its target "
               "rollouts that went to harness phases: where a schedule spent its budget.\n\n")


def phases_table(runs):
    """One row per cell: the phases of each seed's run and the harness phases' share of rollouts."""
    rows = ["| domain | method | seeds | phases, per seed | rollouts in harness phases, per seed |", "|---|---|---|---|---|"]
    for (d, m), by_seed in sorted(by_cell(runs).items()):
        got = [phases(r) for _, r in sorted(by_seed.items())]
        rows.append(f"| {d} | {m} | {' '.join(map(str, sorted(by_seed)))} | {' / '.join(q or '-' for q, _ in got)} | "
                    + " / ".join(f"{100 * share:.0f}%" for _, share in got) + " |")
    return "\n".join(rows)


# The paper's claims as (A, B, what A > B would mean, the domains the paper claims it for (None = all),
# the margin in points: the claim holds when A - B's interval lies above -margin). The bottleneck
# claim is per domain: harness first in search QA, weights first in math. "At least matches" is
# not "beats": its margin of 2 points was written before its cells ran (results/three-domains).
CLAIMS = [("whale", "weight-only", "joint beats weights alone", None, 0),
          ("whale", "harness-only", "joint beats the harness alone", None, 0),
          ("harness-only", "weight-only", "harness first: the bottleneck is the harness", ("searchqa",), 0),
          ("weight-only", "harness-only", "weights first: the bottleneck is the weights", ("math",), 0),
          ("whale", "stagewise", "alternating beats stagewise at equal rollouts", None, 0),
          ("whale", "fst", "code-level harness search beats prompt-only (FST)", None, 0),
          ("whale-adaptive", "whale", "adaptive switching at least matches the fixed schedule (within 2 points)",
           None, 2)]
# The paper also reports adaptive WHALE against the single sides. These rows were added when the first adaptive
# cells of issue #57 landed, after its registration: RESULTS.md shows them, marked, the README's summary does not.
SECONDARY_CLAIMS = [("whale-adaptive", "weight-only", "adaptive joint beats weights alone (added, not registered)", None, 0),
                    ("whale-adaptive", "harness-only", "adaptive joint beats the harness alone (added, not registered)",
                     None, 0)]
CLAIMS_NOTE = ("A - B on the same test questions, paired per seed. Verdict: 'holds' when the 95% interval "
               "(one seed: ± 1.96 SE over questions, which cannot see seed-to-seed spread; several: the wider of the "
               "t interval over seeds and the interval over questions of the seed-averaged differences) "
               "lies above 0 (above -2 for 'at least matches'), 'reversed' when it lies below that. "
               "'A reaches B's final' is where A's curve first reaches B's final value, both "
               "scored on the curve's questions (test[:test_subset]): the paper's 'passes the stagewise final "
               "value after 29% of the rollouts'.\n\n")
Z95 = 1.96  # one seed: a normal 95% interval over the test questions (it cannot see seed-to-seed spread)


def verdict(m, half, margin=0):
    """'holds' when the 95% interval lies above -margin, 'reversed' when below, else 'unresolved'."""
    if m - half > -margin:
        return "holds"
    return "reversed" if m + half < -margin else f"unresolved (95% interval holds {-margin:g})"


def final_per_question(run):
    """{question id: mean score} of the run's final test evaluation (metrics.jsonl)."""
    finals = [m for m in run["metrics"] if m.get("event") == "eval" and m["split"] == "test"
              and m.get("tag") == "final" and "per_example" in m]
    return finals[-1]["per_example"] if finals else None


@functools.lru_cache(maxsize=None)
def first_test_ids(domain: str, k: int) -> tuple:
    return tuple(e["id"] for e in importlib.import_module(f"domains.{domain}").load_split("test")[:k])


def curve_ids(run):
    """The questions every point of a run's curve was scored on: test[:test_subset] (whale.py
    evaluates them after every phase), or None = the whole test split when it evaluated no subset."""
    k = run["cfg"].get("test_subset", 0)
    return first_test_ids(run["cfg"]["domain"], k) if k else None


def mean_on(per_example, ids):
    return sum(per_example[i] for i in ids) / len(ids) if ids else sum(per_example.values()) / len(per_example)


def curve(run):
    """[(cumulative rollouts, test mean@8)], every point on the same questions: the subset evaluations
    as they are, the full-test initial and final restricted to the subset's questions."""
    ids, pts = curve_ids(run), {}
    for m in run["metrics"]:
        if m.get("event") != "eval" or m.get("tag") == "best_val":
            continue
        if m["split"] == "test_subset" and ids:
            pts[m["rollouts"]] = m["mean"]
        elif m["split"] == "test" and "per_example" in m:
            pts[m["rollouts"]] = mean_on(m["per_example"], ids)  # at the end: the final overrides the subset
    return sorted(pts.items())


def reaches(a_run, b_run):
    """Cumulative rollouts at which A's curve first reaches B's final value on the same questions
    (the paper's 'passes the stagewise final value after 29% of the rollouts'), or None."""
    b_final = final_per_question(b_run)
    if not b_final:
        return None
    target = mean_on(b_final, curve_ids(a_run))
    return next((x for x, y in curve(a_run) if y >= target), None)


def paired_difference(A, B, seeds):
    """A - B in points of final test mean@8 on the same questions, over the seeds both have:
    (mean, 95% half-width, the interval said in words, seeds used), or None when no seed pairs."""
    from rollout import paired_gain  # the same paired statistics as a run's own gain
    diffs, per_q = [], []
    for s in seeds:
        a, b = final_per_question(A[s]), final_per_question(B[s])
        if a and b:
            per_q.append({q: a[q] - b[q] for q in a if q in b})  # A - B per question
            diffs.append((*paired_gain(b, a), len(per_q[-1])))
    if not diffs:
        return None
    if len(diffs) == 1:
        m, se, n = (100 * diffs[0][0], 100 * diffs[0][1], diffs[0][2])
        return m, Z95 * se, f"{m:+.1f} ± {se:.1f} (SE, {n} questions, {m / se if se else 0:.1f} SE)", 1
    # Two sources of noise, each invisible to one interval: the training seed (t over the
    # per-seed differences; with 2-3 seeds they can agree by chance and give ± 0) and the
    # questions (the seed-averaged difference per question, over the questions). Take the wider.
    m, half_seeds = mean_ci([100 * x[0] for x in diffs])
    common = set.intersection(*map(set, per_q))
    _, half_q = mean_ci([100 * sum(p[q] for p in per_q) / len(per_q) for q in common])
    half = max(half_seeds, half_q)
    return m, half, (f"{m:+.1f} ± {half:.1f} (95% CI, the wider of: over {len(diffs)} seeds ± {half_seeds:.1f}, "
                     f"over {len(common)} questions ± {half_q:.1f})"), len(diffs)


def by_cell(runs):
    cells = {}
    for r in runs:
        cells.setdefault(r["cell"], {})[r["cfg"]["seed"]] = r
    return cells


def claims(runs, compact=False):
    """One row per claim and domain where both cells have runs of the same seeds (compact: the
    README's columns only)."""
    cells = by_cell(runs)
    rows = ["| domain | A | B | claim (A > B) | seeds | A - B, final test mean@8 (points) | verdict (95%) | "
            "A reaches B's final at (curve questions) | rollouts A / B | minutes A / B |", "|" + "---|" * 10]
    if compact:
        rows = ["| domain | claim (A > B) | A - B | seeds | A - B, final test mean@8 (points, 95%) | verdict |",
                "|---|---|---|---|---|---|"]
    for d in sorted({c[0] for c in cells}):
        for ma, mb, what, where, margin in CLAIMS + ([] if compact else SECONDARY_CLAIMS):
            A, B = cells.get((d, ma), {}), cells.get((d, mb), {})
            seeds = sorted(set(A) & set(B))
            pd = paired_difference(A, B, seeds)
            if pd is None or (where and d not in where):
                continue
            m, half, diff, n_seeds = pd
            hits = [reaches(A[s], B[s]) for s in seeds]
            got = [100 * h / A[s]["sum"]["rollouts"] for h, s in zip(hits, seeds) if h is not None]
            reach = ("at the start (B's final is no better than the initial score)" if got and not any(got)
                     else f"{sum(got) / len(got):.0f}% of A's rollouts" if got else "not reached") + \
                    (f" ({len(got)}/{len(seeds)} seeds)" if len(seeds) > 1 else "")
            avg = lambda cell, k: sum(cell[s]["sum"][k] for s in seeds) / len(seeds)
            if compact:  # the interval only: RESULTS.md says which of the two it is
                short = f"{m:+.1f} ± {half:.1f}" + (" (1.96 SE)" if n_seeds == 1 else "")
                rows.append(f"| {d} | {what} | {ma} - {mb} | {n_seeds} | {short} | {verdict(m, half, margin)} |")
                continue
            rows.append(f"| {d} | {ma} | {mb} | {what} | {n_seeds} | {diff} | {verdict(m, half, margin)} | {reach} | "
                        f"{avg(A, 'rollouts'):.0f} / {avg(B, 'rollouts'):.0f} | "
                        f"{avg(A, 'seconds') / 60:.1f} / {avg(B, 'seconds') / 60:.1f} |")
    return "\n".join(rows) if len(rows) > 2 else ""


PEAK_NOTE = ("The paper's search-QA observation ('harness-only matches the weight-only peak with 5.79% of the "
             "rollouts'): where each method's curve first reaches weight-only's peak, paired per seed (the same "
             "seed's weight-only curve, on the same curve questions, test[:test_subset]); the rollouts are the mean "
             "over the seeds that reach it, and as a share of the method's own budget.\n\n")


def to_peak(runs, reference="weight-only"):
    """Per domain and method: the cumulative rollouts at which the method's curve first reaches the
    reference's peak (the highest point of the same seed's reference curve, on the same questions)."""
    cells = by_cell(runs)
    rows = [f"| domain | {reference}'s peak (curve questions, %) | method | reaches it at (rollouts) | "
            "share of its budget | seeds that reach it |", "|" + "---|" * 6]
    for d in sorted({c[0] for c in cells}):
        ref = cells.get((d, reference), {})
        for method in sorted(m for dd, m in cells if dd == d):
            A = cells[(d, method)]
            seeds = [s for s in sorted(set(A) & set(ref)) if curve_ids(A[s]) == curve_ids(ref[s]) and curve(ref[s])]
            if not seeds:
                continue
            peaks = [max(y for _, y in curve(ref[s])) for s in seeds]
            hits = [(next((x for x, y in curve(A[s]) if y >= p), None), A[s]["sum"]["rollouts"])
                    for s, p in zip(seeds, peaks)]
            got = [(x, n) for x, n in hits if x is not None]
            at = f"{sum(x for x, _ in got) / len(got):,.0f}" if got else "not reached"
            share = f"{100 * sum(x / n for x, n in got) / len(got):.0f}%" if got else "-"
            rows.append(f"| {d} | {100 * sum(peaks) / len(peaks):.1f} | {method} | {at} | {share} | "
                        f"{len(got)}/{len(seeds)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def against_note(other):
    return (f"Against the same cells of {other} (`--against`): final test mean@8 of each grid, and this "
            "grid minus that one on the same test questions, paired per seed (the interval as in the claims).")


def against(runs, other_runs, root, other):
    """This grid's cells against the same cells (domain, method, seeds) of another grid, e.g. a
    rerun with a changed proposer: the other grid's final test mean@8 beside this one's, and this
    minus other on the same test questions, paired per seed."""
    mine, theirs = by_cell(runs), by_cell(other_runs)
    root, other = Path(root).name, Path(other).name  # the folders' names head the columns
    rows = [f"| domain | method | seeds | {other} | {root} | {root} - {other} (points) | verdict (95%) | "
            "rollouts (other / this) | settings that differ (other / this) |", "|" + "---|" * 9]
    for cell in sorted(set(mine) & set(theirs)):
        A, B = mine[cell], theirs[cell]
        seeds = sorted(set(A) & set(B))
        pd = paired_difference(A, B, seeds)
        if pd is None:
            continue
        m, half, diff, _ = pd
        final = lambda runs_: fmt([runs_[s]["sum"]["test_mean8_final"] for s in seeds])
        spent = lambda runs_: ", ".join(str(runs_[s]["sum"]["rollouts"]) for s in seeds)
        rows.append(f"| {cell[0]} | {cell[1]} | {', '.join(map(str, seeds))} | {final(B)} | {final(A)} | {diff} | "
                    f"{verdict(m, half)} | {spent(B)} / {spent(A)} | {settings_that_differ(B[seeds[0]], A[seeds[0]])} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def commits(run):
    """The git commit(s) a run's processes ran at (metrics.jsonl 'start' lines; a resumed run may have several)."""
    return list(dict.fromkeys(m["commit"][:12] + ("+dirty" if m["commit"].endswith("+dirty") else "")
                              for m in run["metrics"] if m.get("event") == "start"))


def settings_that_differ(a, b):
    """'name a / b' for every setting (config.json) and the commit where two runs differ, the seed and
    the run directory aside: what a reader needs to weigh one grid's cell against another's."""
    keys = sorted((set(a["cfg"]) | set(b["cfg"])) - {"out", "resume", "seed"})
    out = [f"{k.replace('_', '-')} {a['cfg'].get(k, '-')} / {b['cfg'].get(k, '-')}" for k in keys
           if a["cfg"].get(k) != b["cfg"].get(k)]
    ca, cb = commits(a), commits(b)
    if ca != cb:
        out.append(f"commit {', '.join(ca) or '?'} / {', '.join(cb) or '?'}")
    return "; ".join(out) or "none"


def provenance(runs):
    """Per run: the git commit(s) its processes ran at (metrics.jsonl 'start' lines; a resumed run may
    have several) and the command that reproduces it: whale.py with every setting that differs from
    the defaults, from its config.json."""
    from whale import Args
    defaults = vars(Args())
    rows = ["| run | commit(s) | command |", "|---|---|---|"]
    for r in runs:
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in r["cfg"].items()
                         if k not in ("resume", "out") and k in defaults and v != defaults[k])
        rows.append(f"| {r['dir'].name} | {', '.join(commits(r)) or 'not logged (run before commit logging)'} | "
                    f"`python whale.py {flags}` |")
    return "\n".join(rows)


# run_all.sh's grid: every method x domain x seed
GRID_DOMAINS = ("searchqa", "math", "chess")
GRID_METHODS = ("whale", "whale-adaptive", "weight-only", "harness-only", "fst", "stagewise")
GRID_SEEDS = (0, 1, 2)


# domains the CPU grids leave out, with the measurement that says why and the command that made it
NOT_RUN = {"chess": "not in the grid: none of three gates registered before they ran passed (results/three-domains/"
                    "README.md, stage 3): the best harness an offline search found mates 2.5 ± 0.8 % on weight[:100] "
                    "x 4 (gate 2; gates 1 and 3 accepted nothing, 0.0), h0 0.0, below the 5 % written down for phase A "
                    "to have data; the menu's four trace-written primitives stacked by code, not by a search, reach "
                    "6.2 ± 1.2 %, half of a uniform pick from their own move list (12.5 %) "
                    "(`bash results/three-domains/chess.sh gate|gate2|gate3`, "
                    "`python results/three-domains/chess_stack.py`)"}


def coverage(runs, root: Path, domains=GRID_DOMAINS, methods=GRID_METHODS):
    """Which cells of the grid (domains x methods x GRID_SEEDS) have finished seeds, which runs
    started but did not finish, and for a domain left out (NOT_RUN) the verdict that says why
    instead of empty cells."""
    done = {}
    for r in runs:
        done.setdefault((r["cfg"]["domain"], label(r["cfg"])), []).append(r["cfg"]["seed"])
    open_runs = sorted(c.parent for c in root.glob("*/config.json") if not (c.parent / "summary.json").exists())
    rows = ["| domain | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    left_out = []
    for d in domains:
        cells = [", ".join(f"s{x}" for x in sorted(done.get((d, m), []))) or "-" for m in methods]
        if d in NOT_RUN and "-" in cells:
            cells, left_out = [c if c != "-" else "not run*" for c in cells], left_out + [d]
        rows.append(f"| {d} | " + " | ".join(cells) + " |")
    n = sum(len(v) for (d, m), v in done.items() if d in domains and m in methods)
    text = (f"{n} of {len(domains) * len(methods) * len(GRID_SEEDS)} runs of the grid "
            f"(domains x methods x seeds {list(GRID_SEEDS)}) have finished:\n\n" + "\n".join(rows) + "\n")
    for d in left_out:
        text += f"\n\\* {d}: {NOT_RUN[d]}.\n"
    if open_runs:
        text += "\nStarted, not finished (`python whale.py --resume DIR` continues one): " + \
                ", ".join(f"`{d}`" for d in open_runs) + "\n"
    return text


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
            pts = curve(r)
            if pts:
                by_method.setdefault(r["cell"][1], []).append(pts)
        for m, seeds in sorted(by_method.items()):
            xs = sorted({x for pts in seeds for x, _ in pts})
            # a seed's value at x: its last point at or before x (adaptive seeds switch at different x)
            ys = [sum(next(y for x0, y in reversed(p) if x0 <= x) for p in seeds) / len(seeds) for x in xs]
            ax.plot(xs, [100 * y for y in ys], marker="o", label=m)
        ks = {r["cfg"].get("test_subset", 0) for r in runs if r["cfg"]["domain"] == d}
        on = f"test[:{ks.pop()}]" if len(ks) == 1 and 0 not in ks else "all its test questions" if ks == {0} else \
            "each run's curve questions"
        ax.set(xlabel="cumulative target rollouts", ylabel=f"test mean@8 (%) on {on}", title=f"{d} (mean over seeds)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"curve_{d}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path)
    return made


def markers(root):
    """The two lines of a README between which results.py writes the summary of the runs under root."""
    return f"<!-- results.py {root}: begin -->", f"<!-- results.py {root}: end -->"


def into_readme(path: Path, root, body: str):
    """Replace what stands between the README's two marker lines for root, so its numbers are never
    typed by hand."""
    begin, end = markers(root)
    text = path.read_text()
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"results.py: {path} needs one '{begin}' line and one '{end}' line after it")
    head, rest = text.split(begin)
    path.write_text(head + begin + "\n" + body + "\n" + end + rest.split(end, 1)[1])


def pack(root: Path):
    """Pack every finished run under root (or root itself) into its run.zip and drop its
    curve.png (report.html draws the curve): a run record of two files, run.zip and report.html."""
    from harness_search import harness_archive
    for d in finished_runs(root):
        if harness_archive.pack_run(d):
            print(f"packed {d}/run.zip")
        (d / "curve.png").unlink(missing_ok=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root", help="folder holding run directories")
    ap.add_argument("--pack", action="store_true", help="only pack each finished run into its run.zip")
    ap.add_argument("--out", default="", help="where RESULTS.md and the curves go (default: ROOT itself)")
    ap.add_argument("--readme", default="", help="also write the summary (the main table and the claims) into "
                    "this file, between its two marker lines for this root (see markers)")
    ap.add_argument("--domains", default=" ".join(GRID_DOMAINS), help="the grid's domains, for the coverage table")
    ap.add_argument("--methods", default=" ".join(GRID_METHODS), help="the grid's methods, for the coverage table")
    ap.add_argument("--against", action="append", default=[], help="another folder of runs of the same cells (e.g. "
                    "a rerun with a changed proposer): this grid minus that one, paired per seed on the same test "
                    "questions; may be given more than once (one table each)")
    a = ap.parse_args()
    if a.pack:
        return pack(Path(a.root))
    runs = load(Path(a.root))
    if not runs:
        raise SystemExit(f"results.py: no finished runs (summary.json or run.zip) under {a.root}")
    # a typo in the grid would print a coverage table of empty cells
    bad = [d for d in a.domains.split() if not (ROOT / "domains" / f"{d}.py").exists()]
    if bad:
        raise SystemExit(f"results.py: --domains: no domain {' '.join(bad)} (domains/<name>.py)")
    bad = [m for m in a.methods.split() if m not in {label(r["cfg"]) for r in runs} | set(GRID_METHODS)]
    if bad:
        raise SystemExit(f"results.py: --methods: no method {' '.join(bad)} in run_all.sh's grid or the runs "
                         f"under {a.root}")
    out = Path(a.out or a.root)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cell_labels(runs)
    pngs, head_to_head = curves(runs, out), claims(runs)
    versus = {}  # other grid -> its table (empty: no cell in common)
    for where in a.against:
        other = load(Path(where))
        if not other:
            raise SystemExit(f"results.py: --against: no finished runs (summary.json or run.zip) under {where}")
        cell_labels(other)
        versus[where] = against(runs, other, a.root, where)
    more_flags = (f" --readme {a.readme}" if a.readme else "") + "".join(f" --against {w}" for w in a.against)
    grid = a.domains.split(), a.methods.split()
    if grid != (list(GRID_DOMAINS), list(GRID_METHODS)):  # the command line in the page must rebuild it
        more_flags += f' --domains "{a.domains}" --methods "{a.methods}"'
    made = (f"Generated by `python tools/results.py {a.root} --out {a.out}{more_flags}` at commit {commit} from "
            f"{len(runs)} finished runs. Mean over seeds ± 95% CI (t). 'final' = the last checkpoint; "
            "'best-on-val' = the checkpoint chosen on the validation split, scored on test; "
            "'best-on-test' is the paper's metric, selected on the test split itself (here the best of the at most "
            "three full test evaluations of a run: initial, final, best-on-val).\n\n")
    claims_text = ("### The paper's claims, head to head\n\n" + CLAIMS_NOTE + head_to_head + "\n\n"
                   if head_to_head else "")
    peak = to_peak(runs)
    peak_text = "### Rollouts to reach weight-only's peak\n\n" + PEAK_NOTE + peak + "\n\n" if peak else ""
    versus_text = "".join(f"### Against {w}\n\n{against_note(w)}\n\n{t}\n\n" for w, t in versus.items() if t)
    body = (made + table(runs) + "\n\n" + "### What each side had to learn from\n\n" + diagnostics(runs) + "\n\n"
            + "### Where each run spent its rollouts\n\n" + PHASES_NOTE + phases_table(runs) + "\n\n"
            + claims_text + peak_text + versus_text + "### Grid coverage\n\n" + coverage(runs, Path(a.root), *grid) + "\n"
            + "### Runs: code and command\n\n" + provenance(runs) + "\n")
    images = lambda where: "\n".join(f"![{p.stem}]({where}{p.name})" for p in pngs) + "\n"
    text = "# Results\n\n" + body + "\n" + images("")
    (out / "RESULTS.md").write_text(text)
    if a.readme:  # the summary only: the full tables are in RESULTS.md
        readme = Path(a.readme)
        rel = os.path.relpath(out, readme.parent) + "/"
        short = claims(runs, compact=True)
        into_readme(readme, a.root, f"Generated by `python tools/results.py {a.root} --out {a.out}{more_flags}` at commit "
                    f"{commit} from {len(runs)} finished runs; mean over seeds ± 95% CI.\n\n" + summary_table(runs)
                    + ("\n\nThe paper's claims, A - B on the same test questions:\n\n" + short if short else "")
                    + f"\n\nAll tables (best-on-val, best-on-test, diagnostics, the rollouts to weight-only's peak, "
                    f"{'the grids it is paired against, ' if versus else ''}coverage, every run's command): "
                    f"[{rel}RESULTS.md]({rel}RESULTS.md).\n")
    print(text)


if __name__ == "__main__":
    main()
