#!/usr/bin/env bash
# Stages 1 and 2 of issue #57's study (results/three-domains/README.md): FST, stagewise and whale-adaptive cells of the
# claim grid, run at the claim grid's commit in a worktree beside this checkout, then packed here
# into results/runs/cpu-claim/<cell> (run.zip + report.html) for a commit.
#   bash results/three-domains/run.sh                          # every stage-1 cell, in the registered order
#   bash results/three-domains/run.sh searchqa-fst-s0          # some cells
#   bash results/three-domains/run.sh select-math-B            # stage 2: a selection run (README.md)
#   bash results/three-domains/run.sh searchqa-whale-s3 searchqa-stagewise-s3   # stage 4 (issue 71): seeds 3-4
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
# Stage 2 (README.md): whale with --schedule adaptive:..., run by whale.py directly at 780f86f with the
# cpu-claim preset's flags (its run_all.sh knows only one adaptive setting):
#   select-<domain>-<A|B>             a selection run, its final evaluation on validation, seed 0
#   <domain>-whale-adaptive-s<seed>   a cell, with the setting adaptive-choice.txt names
claim=(--budget 4992 --prompts-per-step 16 --group 8 --harness-examples 64 --harness-n 2 --candidates 3
       --test-limit 200 --test-n 8 --val-limit 32 --val-n 2 --test-subset 32 --max-tokens 48 --temperature 0.7
       --lr 1e-5 --train-layers 0 --max-kept-per-prompt 4)
declare -A adaptive=([A]=adaptive:w=4,pw=4,min_w=4,min_h=3,max_h=6 [B]=adaptive:w=2,pw=2,min_w=2,min_h=2,max_h=4)

. results/three-domains/land.sh  # land SRC TARGET

run_whale() {  # run_whale GRID NAME DOMAIN SEED FLAGS...: run (or resume) one whale run at 780f86f, land it here
  local grid=$1 name=$2 domain=$3 seed=$4; shift 4
  local src=$wt/results/runs/$grid/$name target=results/runs/$grid/$name
  if [ -f "$target/run.zip" ]; then echo "done: $target"; return; fi
  if [ -f "$src/config.json" ] && [ ! -f "$src/summary.json" ]; then
    (cd "$wt" && OMP_NUM_THREADS=1 python whale.py --resume "results/runs/$grid/$name")
  elif [ ! -f "$src/summary.json" ]; then
    (cd "$wt" && OMP_NUM_THREADS=1 python whale.py --domain "$domain" --seed "$seed" --method whale \
        --out "results/runs/$grid/$name" "${claim[@]}" "$@")
  fi
  land "$src" "$target"
}

for cell in $cells; do
  case "$cell" in
    select-*-A|select-*-B)
      d=${cell#select-}; d=${d%-*}; k=${cell##*-}
      run_whale three-domains-select "$d-whale-adaptive-$k-s0" "$d" 0 --schedule "${adaptive[$k]}" \
          --test-split val --test-limit 0
      continue ;;
    *-whale-adaptive-s*)
      choice=$(cat results/three-domains/adaptive-choice.txt 2>/dev/null) || {
        echo "$cell: no results/three-domains/adaptive-choice.txt yet (stage 2's selection comes first)" >&2; exit 2; }
      run_whale cpu-claim "$cell" "${cell%%-*}" "${cell##*-s}" --schedule "${adaptive[$choice]}"
      continue ;;
  esac
  domain=${cell%%-*}; rest=${cell#*-}; method=${rest%-s*}; seed=${rest##*-s}
  target=results/runs/cpu-claim/$cell
  if [ -f "$target/run.zip" ]; then echo "done: $target"; continue; fi
  # the old run_all.sh runs the cell (or resumes it), then packs and tables in its own old format:
  # those last steps may fail, the finished run directory is what counts
  (cd "$wt" && OMP_NUM_THREADS=1 METHODS="$method" SEEDS="$seed" bash run_all.sh cpu-claim "$domain") || true
  land "$wt/results/runs/cpu-claim/$cell" "$target"
done
