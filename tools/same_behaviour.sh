#!/usr/bin/env bash
# Does a refactor change what a run does? Runs a tiny run of every method at each of two commits
# (the same flags, seed, harness and a fresh WHALE_CACHE each), then compares their summary.json and
# metrics.jsonl with timings and paths left out (tools/same_runs.py). Exit 0: identical.
#   bash tools/same_behaviour.sh 8341519 HEAD            # ~15 min on 2 free cores
#   SAME_FLAGS="--max-memory 0" bash tools/same_behaviour.sh 79d4ee3 HEAD   # more flags, the same at both
set -euo pipefail
cd "$(dirname "$0")/.."
before=$(git rev-parse "${1:?usage: same_behaviour.sh BEFORE AFTER}") after=$(git rev-parse "${2:?}")
work=${WORK:-/tmp/whale-same}
mkdir -p "$work"
# the tiny harness of the tests (tests/helpers.tiny_harness_source), written by this checkout for both commits
python3 -c "import sys; from tests.helpers import tiny_harness_source; open(sys.argv[1], 'w').write(tiny_harness_source())" \
    "$work/harness.py"
tiny=(--budget 32 --prompts-per-step 2 --group 4 --candidates 2 --harness-examples 4 --harness-n 1 --test-limit 4
      --test-n 2 --val-limit 2 --val-n 1 --max-tokens 32 --temperature 0.3 --schedule fixed-steps:1,2
      --train-layers 1 --lr 3e-4 --micro-batch 8 --minibatch 16 --max-kept-per-prompt 2 --top-k 20 --top-p 1.0
      --sft-prompts shared --rollout-precision fp32 --domain searchqa --seed 0 --harness "$work/harness.py"
      ${SAME_FLAGS:-})
for commit in "$before" "$after"; do
  wt=$work/wt-${commit:0:7}
  [ -d "$wt" ] || git worktree add --detach "$wt" "$commit" >/dev/null
  for method in whale fst weight-only harness-only stagewise; do
    out=$work/runs-${commit:0:7}/$method
    [ -f "$out/summary.json" ] && continue
    rm -rf "$out"; mkdir -p "$(dirname "$out")"
    (cd "$wt" && WHALE_CACHE=$work/cache-${commit:0:7} OMP_NUM_THREADS=1 python3 whale.py --method "$method" \
        --out "$out" "${tiny[@]}" > "$out.log" 2>&1) || { echo "failed: $out.log" >&2; exit 1; }
  done
done
python3 tools/same_runs.py "$work/runs-${before:0:7}" "$work/runs-${after:0:7}"
