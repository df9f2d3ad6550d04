"""
Harness headroom before any training: the base model with h0 vs with a hand-picked
combination of the domain's primitives, scored by the same rollout path as everything else.

    python tools/headroom.py --domain searchqa --split val --limit 32 --n 4 --temperature 0.3
    python tools/headroom.py --domain math --combo SYSTEM_PROMPT=0,recover_answer=1 --split test --n 8

--combo AXIS=i,... splices alternative i of each named axis (domain.PRIMITIVES) into h0;
without it a domain's default combination below is used.

    python tools/headroom.py --domain math --screen --split harness --limit 64 --n 2

    python tools/headroom.py --domain searchqa --combo run=2 --split harness --n 4 --seed 100 \
        --base results/runs/cpu-long-vote/searchqa-harness-only-s0:phase00/cand_026

--base starts from another harness instead of h0 (a file, or RUN_DIR:CANDIDATE for a candidate
in a run's archive, packed or not): the line above is how searchqa's checked vote was measured
against the plain vote it replaced (results/README.md, cpu-long-typed).

--screen scores h0 and every single-axis alternative on the same examples and seeds, prints
each one's gain over h0 with its paired SE, then splices the best alternative of every axis
whose gain is positive into one combination and scores that (greedy, not a search over all
combinations: axes interact, so the combination is measured, never assumed).
"""
import argparse
import importlib
import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tools/x.py` imports the repository's modules

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# one hand-picked combination per domain (README, Results): searchqa's was the best of a few
# tried by hand on validation; math's and chess's were picked by reading h0's failures (no box
# -> recover a number; an unparsed or illegal move -> lenient parsing, forcing moves listed first,
# retries), before any measurement
DEFAULT_COMBO = {
    "searchqa": "SYSTEM_PROMPT=0,USER_TEMPLATE=0,EXAMPLES=0,RETRIEVAL=0,format_passages=0,extract_answer=1",
    "math": "SYSTEM_PROMPT=2,USER_TEMPLATE=0,recover_answer=1,MAX_TURNS=1",
    "chess": "annotate_moves=1,parse_move=0,format_retry=0,MAX_RETRIES=1",
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--domain", default="searchqa")
    ap.add_argument("--combo", default="", help="AXIS=index,... of domain.PRIMITIVES spliced into h0")
    ap.add_argument("--split", default="test", choices=["weight", "harness", "val", "test"])
    ap.add_argument("--limit", type=int, default=0, help="first N examples (0 = all)")
    ap.add_argument("--n", type=int, default=8, help="samples per example: mean@n")
    ap.add_argument("--temperature", type=float, default=0.3)  # whale.py's CPU default
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--base", default="", help="start from this harness instead of h0: a file, or RUN_DIR:CANDIDATE (e.g. ...-s0:phase00/cand_026)")
    ap.add_argument("--screen", action="store_true", help="score every single-axis alternative, then the greedy combo")
    ap.add_argument("--only", choices=["h0", "combo"], default="",
                    help="score just one of the two (a long chess evaluation split over two sittings); "
                         "no paired gain is printed then")
    a = ap.parse_args()
    from lm import engine
    from harness_search import harness_source
    import rollout
    domain = importlib.import_module(f"domains.{a.domain}")
    h0 = read_base(a.base) if a.base else open(domain.H0).read()
    if a.screen:
        return screen(a, domain, h0)
    combo, spec = h0, a.combo or DEFAULT_COMBO.get(a.domain, "")
    if not spec:
        raise SystemExit(f"headroom.py: give --combo for {a.domain} (axes: {', '.join(domain.PRIMITIVES)})")
    for part in spec.split(","):
        axis, _, i = part.partition("=")
        alts = domain.PRIMITIVES.get(axis, [])
        if not i.isdigit() or int(i) >= len(alts):
            raise SystemExit(f"headroom.py: bad --combo part {part!r} (axes: "
                             + ", ".join(f"{k}=0..{len(v) - 1}" for k, v in domain.PRIMITIVES.items()) + ")")
        combo = harness_source.splice(combo, axis, alts[int(i)])
    e = engine.load_engine(a.model)
    examples = domain.load_split(a.split)[:a.limit or None]
    sampling = {"temperature": a.temperature, "top_k": 20, "top_p": 1.0}
    runs = {}
    for name, src in (("h0", h0), ("combo", combo)):
        if a.only and name != a.only:
            continue
        r = runs[name] = rollout.evaluate(e, domain, src, examples, a.n, seed=a.seed, sampling=sampling,
                                          max_tokens=a.max_tokens)
        label = "base" if name == "h0" and a.base else name
        print(f"{a.domain} {a.split}[:{len(examples)}] T={a.temperature} {label}: mean@{a.n} = "
              f"{100 * r['mean']:.1f} ± {100 * r['se']:.1f}  ({r['seconds']:.0f} s)", flush=True)
    print(f"combo: {spec}")
    if a.only:
        return
    gain, se = gain_over(runs["h0"], runs["combo"])
    print(f"gain: {100 * gain:+.1f} ± {100 * se:.1f} (paired SE)")


def read_base(spec):
    """A harness's source from a file, or RUN_DIR:CANDIDATE for a candidate in a run's archive
    (archive/ or archive.zip, via harness_archive.unpacked_archive)."""
    from harness_search import harness_archive
    run_dir, _, cand = spec.partition(":")
    try:
        if cand:
            folder = harness_archive.unpacked_archive(run_dir)
            if folder is None:
                raise OSError(f"no archive/ or archive.zip in {run_dir}")
            return open(os.path.join(folder, cand, "harness.py")).read()
        return open(spec).read()
    except OSError as e:
        raise SystemExit(f"headroom.py: cannot read --base {spec}: {e}")


def gain_over(base, r):
    """Paired gain of evaluation r over base (same examples and seeds), with its SE."""
    import rollout
    return rollout.paired_gain(*(rollout.per_example_means(x["records"]) for x in (base, r)))


def screen(a, domain, h0):
    from lm import engine
    from harness_search import harness_source
    import rollout
    e = engine.load_engine(a.model)
    examples = domain.load_split(a.split)[:a.limit or None]
    sampling = {"temperature": a.temperature, "top_k": 20, "top_p": 1.0}

    def score(src):
        return rollout.evaluate(e, domain, src, examples, a.n, seed=a.seed, sampling=sampling,
                                max_tokens=a.max_tokens)
    base = score(h0)
    print(f"{a.domain} {a.split}[:{len(examples)}] T={a.temperature} h0: mean@{a.n} = "
          f"{100 * base['mean']:.1f} ± {100 * base['se']:.1f}", flush=True)
    best = {}  # axis -> (gain, index)
    for axis, alts in domain.PRIMITIVES.items():
        for i, alt in enumerate(alts):
            r = score(harness_source.splice(h0, axis, alt))
            gain, se = gain_over(base, r)
            print(f"  {axis}={i}: mean@{a.n} = {100 * r['mean']:.1f}  gain {100 * gain:+.1f} ± {100 * se:.1f}  "
                  f"({r['seconds']:.0f} s)", flush=True)
            if gain > 0 and gain > best.get(axis, (0.0, -1))[0]:
                best[axis] = (gain, i)
    spec = ",".join(f"{axis}={i}" for axis, (_, i) in best.items())
    combo = h0
    for axis, (_, i) in best.items():
        combo = harness_source.splice(combo, axis, domain.PRIMITIVES[axis][i])
    r = score(combo)
    gain, se = gain_over(base, r)
    print(f"greedy combo {spec or '(none)'}: mean@{a.n} = {100 * r['mean']:.1f} ± {100 * r['se']:.1f}  "
          f"gain {100 * gain:+.1f} ± {100 * se:.1f}")


if __name__ == "__main__":
    main()
