#!/usr/bin/env bash
# Stage 1 of issue #57's study (results/three-domains/README.md): FST and stagewise cells of the
# claim grid, run at the claim grid's commit in a worktree beside this checkout, then packed here
# into results/runs/cpu-claim/<cell> (run.zip + report.html) for a commit.
#   bash results/three-domains/run.sh                          # every stage-1 cell, in the registered order
#   bash results/three-domains/run.sh searchqa-fst-s0          # some cells
set -euo pipefail
cd "$(dirname "$0")/../.."
here=$PWD
commit=780f86f7ab2678c8bc9de0945b28ead6b1c9284b  # the claim grid's (results/runs/cpu-claim)
wt=$(dirname "$here")/whale-780f86f
[ -d "$wt" ] || git worktree add --detach "$wt" "$commit"
[ "$(git -C "$wt" rev-parse HEAD)" = "$commit" ] || { echo "$wt is not at $commit" >&2; exit 2; }
cells=${*:-"searchqa-fst-s0 searchqa-stagewise-s0 math-fst-s0 math-stagewise-s0
            searchqa-fst-s1 searchqa-stagewise-s1 math-fst-s1 math-stagewise-s1
            searchqa-fst-s2 searchqa-stagewise-s2 math-fst-s2 math-stagewise-s2"}
for cell in $cells; do
  domain=${cell%%-*}; rest=${cell#*-}; method=${rest%-s*}; seed=${rest##*-s}
  target=results/runs/cpu-claim/$cell
  if [ -f "$target/run.zip" ]; then echo "done: $target"; continue; fi
  # the old run_all.sh runs the cell (or resumes it), then packs and tables in its own old format:
  # those last steps may fail, the finished run directory is what counts
  (cd "$wt" && OMP_NUM_THREADS=1 METHODS="$method" SEEDS="$seed" bash run_all.sh cpu-claim "$domain") || true
  src=$wt/results/runs/cpu-claim/$cell
  [ -f "$src/summary.json" ] || { echo "unfinished: $src (run this again to resume it)" >&2; exit 1; }
  mkdir -p "$target"
  for f in config.json summary.json metrics.jsonl harnesses archive archive.zip; do  # the record, no weights
    if [ -e "$src/$f" ]; then cp -r "$src/$f" "$target/"; fi
  done
  python tools/results.py "$target" --pack
  python tools/report.py "$target"
  echo "landed: $target (commit it: git add $target && git commit -m '...' -- $target)"
done
