"""
race_replay.py: what racing (meta_harness.race) would have decided in every harness search already
run, and what it would have cost, from the archives alone (nothing is run again).

    python tools/race_replay.py results/runs                 # every search under it, at meta_harness.RACE
    python tools/race_replay.py results/runs --stages '' --block 16 --gamma 0.005   # another setting

For each harness phase of each run under DIR (a run directory, or a committed run.zip) that scored
every candidate on every example (a run raced as it ran, --race futility, is skipped), and each
iteration after the incoming evaluation: its candidates are raced against the incumbent the
search held then, on the search set's examples in their recorded order (scores.json's per_example).
Dropped candidates leave the iteration; the archive's top scorer among the rest (the paper's
order: meta_harness.paper_choice) is tested against the incumbent with accept() on all examples,
as the search did. The decision is the incumbent after the iteration; it agrees when it is the
one the search chose. Where the search took a second look (a near miss scored on more examples)
at the same candidate, its recorded outcome stands. Rollouts: each candidate's examples scored
times the run's --harness-n; the full evaluation is every candidate on every example.

The last line reads exactly `decisions agree A of B, rollouts X of Y`. Nothing here reads a test
split: search sets only.

    python tools/race_replay.py results/runs --validate 100   # and which rule validation sides with

--validate N scores, for each disagreement, the harness the search kept and the one racing would
have kept on the first N questions of the domain's validation split x 8 samples, with the base
model and the run's sampling, the same draws on both sides (a run's own validation points follow
whole phases, so they never compare two candidates of one decision). Only a search run on the base
weights is re-scored (harness-only: its weights never change); one identical pair of sources met in
several committed grids is scored once; the scores are kept in $WHALE_CACHE/race-validate, so an
interrupted --validate goes on where it stopped. This runs the model; the replay alone does not.
"""
import argparse
import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tools/x.py` imports the repository's modules

import meta_harness
from harness_search import eval_cache, harness_archive
from jail import received

# --validate's scores, kept between invocations (keyed by source, sampling and domain: eval_cache.py)
VALIDATE_CACHE = os.path.join(os.environ.get("WHALE_CACHE") or os.path.expanduser("~/.cache/whale"), "race-validate")


def searches(root):
    """(run, phase folder, config) for every harness phase archived under root."""
    runs = sorted({p.parent for pattern in ("**/config.json", "**/run.zip") for p in Path(root).glob(pattern)
                   if "archive" not in p.parts})
    for run in runs:
        try:
            record = Path(harness_archive.unpacked_run(run))
            archive = harness_archive.unpacked_archive(run)
            config = received.read_json(record / "config.json") if (record / "config.json").exists() else {}
        except (OSError, ValueError) as e:
            print(f"race_replay: {run}: skipped ({e})", file=sys.stderr)
            continue
        if config.get("race", "off") != "off":  # raced when it ran: no full evaluation to compare with
            print(f"race_replay: {run}: skipped (raced as it ran: --race {config['race']})", file=sys.stderr)
            continue
        for phase in sorted(Path(archive).iterdir()) if archive else []:
            if phase.is_dir() and (phase / "iterations.jsonl").exists():
                yield run, phase, config


def replay(phase, config, rule):
    """[(iteration, recorded incumbent, racing's incumbent, rollouts raced, rollouts full)]."""
    lines = harness_archive.read_jsonl(phase / "iterations.jsonl")
    cands = {c["name"]: c for c in harness_archive.load_archive(str(phase)) if c["scores"]}
    n = int(config.get("harness_n") or 1)
    out = []
    for prev, line in zip(lines, lines[1:]):
        inc = cands.get(prev["incumbent"])
        members = [cands[name] for name in line["cands"] if name in cands]
        if inc is None or not members:
            continue
        alpha = (line.get("test") or {}).get("alpha", config.get("accept_alpha", 0.1))
        survivors, raced, full = [], 0, 0
        for c in members:
            dropped, used = meta_harness.race(c["scores"]["per_example"], inc["scores"]["per_example"], alpha, **rule)
            raced, full = raced + used * n, full + len(c["scores"]["per_example"]) * n
            if not dropped:
                survivors.append(c)
        # the paper's choice among what the search had scored by then, less what racing dropped
        seen = [c for c in cands.values() if c["meta"].get("iteration", 0) <= line["iteration"]
                and (c in survivors or c not in members)]
        top = meta_harness.paper_choice(seen)
        decided = prev["incumbent"]
        if top is not None and top["name"] != prev["incumbent"]:
            test = line.get("test") or {}
            if test.get("cand") == top["name"] and test.get("confirm"):
                decided = line["incumbent"]  # the search's second look at this very candidate
            elif meta_harness.accept(top["scores"]["per_example"], inc["scores"]["per_example"], alpha)[0]:
                decided = top["name"]
        out.append((line["iteration"], line["incumbent"], decided, raced, full))
    return out


def validation_side(phase, config, kept, raced, n_questions, loaded, cache_dir=None):
    """(search's mean, racing's mean, racing - search, its standard error) on validation, or a reason
    it is not scored. `loaded` keeps the model across disagreements; the scores are on disk."""
    import importlib

    import domains

    from tqdm import tqdm

    import rollout
    from lm.engine import load_engine
    from lm.models import embedded_model_dir
    if config.get("method") != "harness-only":
        return "its weights were trained before this search: not re-scored"
    if config.get("domain") not in domains.names():  # (a name from someone else's config.json: never imported blind)
        return f"unknown domain {str(config.get('domain'))[:40]!r}"
    if config.get("model", "embedded") != "embedded":
        return f"model {config.get('model')!r}: only the embedded model is re-scored here"
    try:  # someone else's files: no links, bounded (jail/received.py); the code runs only in the sandbox
        sources = {name: received.read_text(Path(phase) / name / "harness.py") for name in (kept, raced)}
    except (OSError, ValueError) as e:
        return f"a harness.py could not be read ({e})"
    domain = importlib.import_module(f"domains.{config['domain']}")
    sampling = {k: config[k] for k in ("temperature", "top_k", "top_p")}
    questions = domain.load_split("val")[:n_questions]

    def engine():  # loaded once, and only when a score is not on disk yet
        if "engine" not in loaded:
            print("race_replay: loading the base model to score what is not in the cache yet", file=sys.stderr)
            loaded["engine"] = load_engine(str(embedded_model_dir()), engine="hf", device="cpu", seed=0)
        return loaded["engine"]
    # on disk, 10 questions at a time (the draws are seeded by question and sample, so chunks change
    # nothing): an interrupted --validate goes on where it stopped, and a pair met twice is scored once
    roll = lambda source, exs, name: rollout.run(engine(), domain, source, exs, 8, seed=("race-validate", 0),
                                                 sampling=sampling, max_tokens=config["max_tokens"])
    draws = dict(sampling, max_tokens=config["max_tokens"], domain=config["domain"], model="embedded")
    score = eval_cache.cached(roll, cache_dir or VALIDATE_CACHE, "base", ("race-validate", 0), draws, 8, "validate")
    means = {}
    for name, source in sources.items():
        records = []
        for i in tqdm(range(0, len(questions), 10), desc=f"validation {name}", unit="10 questions", leave=False):
            records += score(source, questions[i:i + 10], name)
        means[name] = rollout.per_example_means(records)
    mean = lambda m: sum(m.values()) / len(m)
    gain, se = rollout.paired_gain(means[kept], means[raced])
    return mean(means[kept]), mean(means[raced]), gain, se


def main(argv=None):
    ap = argparse.ArgumentParser(description="Replay the archived harness searches under DIR with racing.")
    ap.add_argument("dir", help="a folder of runs (results/runs), a grid or one run")
    ap.add_argument("--rule", default=meta_harness.RACE["rule"], choices=("futility", "sprt"), help="meta_harness.race's rule")
    ap.add_argument("--block", type=int, default=meta_harness.RACE["block"], help="examples per block")
    ap.add_argument("--stages", default=",".join(map(str, meta_harness.RACE.get("stages") or ())),
                    help="instead of --block: look after these many examples only, e.g. 16,32,48, or these shares "
                         "of the search set, e.g. 0.25,0.5,0.75 ('' = every --block)")
    ap.add_argument("--gamma", type=float, default=meta_harness.RACE["gamma"], help="futility: drop below this chance "
                    "of being accepted at the end")
    ap.add_argument("--beta", type=float, default=0.05, help="sprt: its chance of dropping a candidate as good as --theta1")
    ap.add_argument("--theta1", type=float, default=0.75, help="sprt: the share of discordant examples a clearly "
                    "better candidate wins")
    ap.add_argument("--quiet", action="store_true", help="only the totals")
    ap.add_argument("--validate", type=int, default=0, metavar="N", help="score each disagreement's two harnesses on "
                    "the first N validation questions x 8 (runs the model; 0: off)")
    ap.add_argument("--validate-cache", default=VALIDATE_CACHE, help="where --validate keeps its scores")
    a = ap.parse_args(argv)
    if not Path(a.dir).is_dir():
        print(f"race_replay: error: {a.dir} is not a directory", file=sys.stderr)
        return 2
    if a.block < 1 or not 0 < a.gamma < 1 or not 0 < a.beta < 1 or not 0.5 < a.theta1 < 1:
        print("race_replay: error: --block >= 1, --gamma and --beta in (0, 1), --theta1 in (0.5, 1)", file=sys.stderr)
        return 2
    try:  # example counts (16,32,48), or shares of the search set (0.25,0.5,0.75)
        stages = tuple(float(x) if "." in x else int(x) for x in a.stages.split(",") if x.strip())
    except ValueError:
        stages = (0,)
    if any(k <= 0 or (isinstance(k, float) and k >= 1) for k in stages):
        print(f"race_replay: error: --stages takes example counts like 16,32,48 or shares like 0.25,0.5,0.75, "
              f"not {a.stages!r}", file=sys.stderr)
        return 2
    rule = dict(rule=a.rule, block=a.block, gamma=a.gamma, beta=a.beta, theta1=a.theta1, stages=stages or None)
    if a.validate < 0:
        print("race_replay: error: --validate takes a number of validation questions (0: off)", file=sys.stderr)
        return 2
    agree = total = raced = full = 0
    sides, loaded = {"search": 0, "racing": 0, "neither": 0}, {}
    for run, phase, config in searches(a.dir):
        for it, recorded, decided, r, f in replay(phase, config, rule):
            agree, total, raced, full = agree + (recorded == decided), total + 1, raced + r, full + f
            if recorded != decided and (a.validate or not a.quiet):
                print(f"{run}/{phase.name} iteration {it}: the search kept {recorded}, racing {decided}")
            if recorded != decided and a.validate:
                side = validation_side(phase, config, recorded, decided, a.validate, loaded, a.validate_cache)
                if isinstance(side, str):
                    print(f"  validation: {side}")
                    continue
                m_kept, m_raced, gain, se = side
                verdict = "racing" if gain - 1.96 * se > 0 else "search" if gain + 1.96 * se < 0 else "neither"
                sides[verdict] += 1
                print(f"  validation ({a.validate} questions x 8): {recorded} {m_kept:.1%}, {decided} {m_raced:.1%}, "
                      f"racing - search {gain:+.1%} +- {1.96 * se:.1%}: sides with {verdict}")
    what = f"gamma {a.gamma}" if a.rule == "futility" else f"beta {a.beta}, theta1 {a.theta1}"
    where = f"stages {a.stages}" if stages else f"block {a.block}"
    print(f"racing ({a.rule}): {where}, {what}; {total} decisions in the searches under {a.dir}")
    if a.validate:
        print(f"validation sides with racing {sides['racing']}, with the search {sides['search']}, "
              f"with neither (the 95 % interval holds 0) {sides['neither']}")
    print(f"decisions agree {agree} of {total}, rollouts {raced} of {full}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
