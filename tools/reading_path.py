"""
reading_path.py: what a reader follows through one RSFT step and one harness iteration, measured
rather than guessed. It runs two tiny runs with the default flags (the `tiny` preset: a weight-only
run of one RSFT step, and a harness-only run of the incoming harness and one iteration), traces
every function of the repository that runs inside whale.py's weight_phase and harness_phase (in
this process: the sandbox's child and the rollout processes are not traced), and prints, per
phase:
  read       the functions that ran in the files the README says to read for that phase (READ),
             each counted whole, from its `def` to its last line, once;
  calls out  the named calls by which those files leave for the rest (the machinery a reader may
             skip: what it does is its name and docstring), one line each;
  all        every file that ran, with its functions and lines.

    python tools/reading_path.py                 # this checkout
    python tools/reading_path.py --repo ../old   # another checkout (before/after a refactor)
    python tools/reading_path.py --phase weight_phase   # one of the two

Left out: code run by import (module top levels), and the sandbox's child.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tools/x.py` imports the repository's modules

from tests.helpers import tiny_harness_source  # noqa: E402  (the tests' tiny harness: one definition)
from whale import PRESETS  # noqa: E402

# Run inside the traced checkout: trace whale.<phase> during a tiny run, print what ran as JSON.
PROBE = r"""
import json, os, sys
sys.path.insert(0, os.getcwd())
import whale
root, phase = os.getcwd() + os.sep, sys.argv[1]
seen = {}

def ours(f):
    return f.startswith(root) and "site-packages" not in f and os.sep + "tests" + os.sep not in f

def tracer(frame, event, arg):
    code = frame.f_code
    f = code.co_filename
    if event == "call" and ours(f):
        lines = [l for _, _, l in code.co_lines() if l is not None]
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        key = (f[len(root):], code.co_qualname, code.co_firstlineno)
        seen.setdefault(key, [max(lines, default=code.co_firstlineno), set()])[1].add(
            caller[len(root):] if ours(caller) else "")
    return None

real = getattr(whale, phase)
def traced(*a, **k):
    sys.setprofile(None); sys.settrace(tracer)
    try:
        return real(*a, **k)
    finally:
        sys.settrace(None)
setattr(whale, phase, traced)
import dataclasses
known, argv, flags = {f.name for f in dataclasses.fields(whale.Args)}, [], sys.argv[2:]
for k in range(0, len(flags), 2):  # an older checkout: only the flags it has (the rest: its defaults)
    if flags[k][2:].split("=")[0].replace("-", "_") in known:
        argv += flags[k:k + 2]
try:
    whale.main(whale.parse_args(whale.Args, argv=argv))
except SystemExit:
    pass
print("READING_PATH " + json.dumps([[f, q, a, b, sorted(c)] for (f, q, a), (b, c) in seen.items()]))
"""

# phase -> the files the README says to read for it (the proposer's: the default's, primitives)
READ = {"weight_phase": ["whale.py", "rs_sft.py"],
        "harness_phase": ["whale.py", "meta_harness.py", "harness_search/primitives.py"]}
RUNS = {  # phase -> the tiny run that goes through it once
    "weight_phase": ["--method", "weight-only", "--budget", "8", "--harness", "HARNESS"],  # one RSFT step that trains
    "harness_phase": ["--method", "harness-only", "--budget", "12"],            # the incoming harness + 2 candidates
}


def trace(repo: Path, phase: str) -> list:
    with tempfile.TemporaryDirectory() as out:
        harness = os.path.join(out, "harness.py")  # the tests' tiny harness, this checkout's, for any --repo
        Path(harness).write_text(tiny_harness_source())
        flags = [harness if x == "HARNESS" else x for x in RUNS[phase]]
        # the tiny preset as flags (an older checkout has no --preset), and the least work outside the phase
        tiny = [x for k, v in PRESETS["tiny"].items() for x in (f"--{k.replace('_', '-')}", str(v))]
        cmd = [sys.executable, "-c", PROBE, phase, "--domain", "searchqa", *tiny, *flags, "--test-limit", "1",
               "--val-limit", "1", "--two-by-two", "off", "--out", os.path.join(out, "run")]
        r = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((x for x in r.stdout.splitlines() if x.startswith("READING_PATH ")), None)
    if line is None:
        sys.exit(f"reading_path: the traced run failed in {repo}:\n{r.stderr[-2000:]}")
    return json.loads(line[len("READING_PATH "):])


def main(argv=None):
    ap = argparse.ArgumentParser(description="Files and lines one RSFT step and one harness iteration run through.")
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="the checkout to trace")
    ap.add_argument("--phase", choices=list(RUNS), action="append", help="only this phase (repeatable; default both)")
    a = ap.parse_args(argv)
    repo = Path(a.repo).resolve()
    if not (repo / "whale.py").is_file():
        print(f"reading_path: error: {repo} has no whale.py", file=sys.stderr)
        return 2
    for phase in a.phase or RUNS:
        funcs = trace(repo, phase)
        read = [x for x in funcs if x[0] in READ[phase]]
        out = sorted({(f, q) for f, q, _, _, callers in funcs if f not in READ[phase] and set(callers) & set(READ[phase])})
        print(f"{phase}: read {' + '.join(READ[phase])}: {len(read)} functions, "
              f"{sum(b - a + 1 for _, _, a, b, _ in read)} lines; calls out: {len(out)}")
        for f, q in out:
            print(f"  calls out: {f[:-3].replace('/', '.')}.{q}")
        files = {}
        for f, qual, first, last, _ in funcs:
            files.setdefault(f, []).append((first, last, qual))
        total = sum(last - first + 1 for _, _, first, last, _ in funcs)
        print(f"  all: {len(files)} files, {len(funcs)} functions, {total} lines")
        for f in sorted(files, key=lambda f: -sum(b - a + 1 for a, b, _ in files[f])):
            n = sum(b - a + 1 for a, b, _ in files[f])
            print(f"    {f}: {len(files[f])} functions, {n} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
