"""Rebuild data/math/{weight,harness,val,test}.jsonl.gz from reasoning-gym.

Two tiers, half of every split each:
  hard  gsm_symbolic      GSM8K test problems turned into seeded templates
  easy  basic_arithmetic  2-3 numbers of 1-2 digits added and subtracted
                          ("Compute 25 + 76 - 22."): SmolLM2-135M-Instruct gets
                          a few percent right (4% boxed, n=24, temperature 1)
                          while gsm_symbolic is ~0%, so rejection sampling has
                          something to keep from the start
Every example: {"id", "task": {"problem"}, "answer": {"value", "tier"}}, the
value an integer written as a string. Generators and seeds are fixed below;
exact duplicates (same question / same expression) are dropped, and so are the
few gsm_symbolic items with a non-integer answer. The splits are disjoint cuts
of one generated stream per tier, in the order test, val, harness, weight, so a
bigger weight pool never changes the test set.

Usage:  pip install reasoning-gym==0.1.25   (a build dependency only)
        python data/build_math.py [--out data/math]
The output is byte-identical on every run: sorted keys, gzip with mtime=0 and no
file name. reasoning-gym draws these items with Python's `random` alone (no
numpy/sympy on this path), so they depend only on the package version; the gzip
bytes could in principle differ under another zlib, the JSON lines cannot.
What it leaves out: the generators' chain-of-thought solutions (answer only).
"""
import argparse
import gzip
import json
import random
from fractions import Fraction
from importlib import metadata
from pathlib import Path

VERSION = "0.1.25"
SIZES = {"test": 250, "val": 100, "harness": 128, "weight": 2000}  # per split, both tiers
HARD = dict(name="gsm_symbolic", seed=8001, size=4000)
# + and - only: without parentheses this generator evaluates strictly left to right, which is
# only the usual precedence when no "*" or "/" is mixed in.
EASY = dict(name="basic_arithmetic", seed=8002, size=4000, min_terms=2, max_terms=3, min_digits=1,
            max_digits=2, operators=("+", "-"), allow_parentheses=False, allow_negation=False,
            format_style="natural")
SHUFFLE_SEED = 8003  # mixes the two tiers inside each split


def generate(spec, tier, prefix, need):
    """The first `need` distinct integer-answer items of one seeded generator."""
    import reasoning_gym
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    seen, out = set(), []
    for item in reasoning_gym.create_dataset(spec["name"], **kwargs):
        value = Fraction(item["answer"])
        key = item["metadata"].get("expression", item["question"])  # "What is 1+2?" == "Solve 1+2."
        if value.denominator != 1 or key in seen:
            continue
        seen.add(key)
        idx = item["metadata"]["source_index"]
        out.append({"id": f"{prefix}-{idx:04d}", "task": {"problem": item["question"]},
                    "answer": {"value": str(value.numerator), "tier": tier}})
        if len(out) == need:
            return out
    raise SystemExit(f"{spec['name']}: only {len(out)} usable items, need {need}; raise size")


def write_jsonl_gz(path, rows):
    data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
    with open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
        gz.write(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "math"))
    args = ap.parse_args()
    try:
        have = metadata.version("reasoning-gym")
    except metadata.PackageNotFoundError:
        raise SystemExit(f"needs reasoning-gym: pip install reasoning-gym=={VERSION}")
    if have != VERSION:
        raise SystemExit(f"needs reasoning-gym=={VERSION} (found {have}): other versions draw other items")

    halves = {k: n // 2 for k, n in SIZES.items()}
    total = sum(halves.values())
    tiers = [generate(HARD, "hard", "gsm", total), generate(EASY, "easy", "arith", total)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = 0
    for split, n in halves.items():
        rows = [r for items in tiers for r in items[start:start + n]]
        random.Random(f"{SHUFFLE_SEED}-{split}").shuffle(rows)
        write_jsonl_gz(out / f"{split}.jsonl.gz", rows)
        print(f"{split}: {len(rows)} examples ({n} hard + {n} easy)")
        start += n


if __name__ == "__main__":
    main()
