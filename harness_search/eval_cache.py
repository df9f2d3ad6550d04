"""
eval_cache.py: within a run, phase B never pays twice for the same rollouts.

A rollout's outcome is fixed by what went into it: the harness source, the weights, the example,
the sample's seed and the sampling settings (rollout.run seeds sample j of an example by
(seed, example id, j), and the engine draws a request's tokens from its own seed whatever else
shares its batch). So the records of one (source, weights version, seed, sampling) are kept in one
file, by example id, and a later request for the same examples gets them back instead of new
rollouts. What that saves:
  - a resumed search: the blocks a raced candidate had finished before the crash;
  - the second look (meta_harness's confirm_examples) asking again for a candidate it scored;
  - the next harness phase's incoming harness, already scored under these very weights (a weight
    phase that kept nothing changed nothing; whale.py then gives phase B the same seed).

The key's weights version is the run's count of optimizer steps: it names weights within one run,
so the cache lives in the run directory and is never shared across runs. A hit returns the records
as they were first made (token ids dropped: phase B's readers never use them), so the scores it
gives are exactly the first evaluation's.

Left out: eviction (a run's cache is at most its phase-B records, the same bytes as its archive's
traces), sharing between runs or machines, and phase A or the evaluations (their rollouts are
seeded by step and split, so they never repeat).
"""
import hashlib
import json
import os

from harness_search.harness_archive import drop_token_ids
from jail import received


def cache_file(cache_dir, source, weights_version, seed, sampling) -> str:
    """The file of one (source, weights version, seed, sampling): its name is their hash."""
    key = json.dumps([hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest(), weights_version,
                      [str(s) for s in seed], sampling], sort_keys=True)
    return os.path.join(cache_dir, hashlib.sha256(key.encode()).hexdigest()[:32] + ".jsonl")


def cached(run_fn, cache_dir, weights_version, seed, sampling, n, phase):
    """run_candidate(source, examples, name) -> records, as run_fn, run only for the examples whose n
    samples are not in the cache yet (an example's samples are made and kept together). seed and
    sampling: everything else that decides the draws (the seed run_fn passes to rollout.run, and
    the sampling settings and token cap). A record that was made for another request (another
    phase's candidate) comes back marked "cached": the budget does not pay for it again; one made for
    this very candidate of this phase (a resumed block) is paid as the first time, so that a resumed
    run books what an uninterrupted one would."""
    def run_candidate(source, examples, name):
        path, me = cache_file(cache_dir, source, weights_version, seed, sampling), f"{phase}/{name}"
        have = {}
        if os.path.exists(path):
            rows, _ = received.read_jsonl(path, cap=1 << 30)  # a line a crash cut short is not a hit
            for r in rows:
                have.setdefault(str(r.get("example_id")), {}).setdefault(r.get("sample"), r)
        todo = [ex for ex in examples if len(have.get(str(ex["id"]), {})) < n]
        if todo:
            new = [dict(drop_token_ids(r), made_for=me) for r in run_fn(source, todo, name)]
            os.makedirs(cache_dir, exist_ok=True)
            with open(path, "a") as f:
                f.write("".join(json.dumps(r, default=str) + "\n" for r in new))
            for r in new:
                have.setdefault(str(r.get("example_id")), {})[r.get("sample")] = r
        return [dict(r, cached=True) if r.get("made_for") != me else r
                for ex in examples for _, r in sorted(have[str(ex["id"])].items(), key=lambda kv: kv[0] or 0)[:n]]
    return run_candidate
