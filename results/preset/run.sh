#!/usr/bin/env bash
# The preset procedure of results/preset/README.md: search QA, seed 0, test split never read.
# Finished stages are skipped and interrupted ones resumed, like run_all.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/preset/runs
common=(--domain searchqa --seed 0 --test-split val --test-limit 0 --test-n 8 --val-limit 32 --val-n 2
        --max-tokens 48 --prompts-per-step 16 --group 8 --harness-examples 64 --harness-n 2 --candidates 3)

run() {  # run NAME FLAGS...: one whale.py run into $out/NAME, skipped when finished
  local name=$1; shift
  if [ -f "$out/$name/summary.json" ]; then echo "done: $out/$name"; return; fi
  if [ -f "$out/$name/config.json" ]; then python whale.py --resume "$out/$name"; return; fi
  python whale.py "${common[@]}" --out "$out/$name" "$@"
}

# 1. the harness to train under
run search --method harness-only --budget 2048 --temperature 0.3
hstar=$out/search/harnesses/cycle00.py
# 2. temperature
for t in 0.3 0.5 0.7 1.0; do run "eval-t$t" --method eval --harness "$hstar" --temperature "$t"; done
t=$(python results/preset/choose.py --temperature)
# 3. phase A alone under H*
base=(--method weight-only --harness "$hstar" --budget 2048 --temperature "$t")
run "rsft-base-t$t" "${base[@]}" --lr 3e-4 --train-layers 4 --max-kept-per-prompt 2
run "rsft-lr1e-3-t$t" "${base[@]}" --lr 1e-3 --train-layers 4 --max-kept-per-prompt 2
run "rsft-lr1e-4-t$t" "${base[@]}" --lr 1e-4 --train-layers 4 --max-kept-per-prompt 2
# the amendment (README): lr 3e-5, then the other two settings at the best of the four learning rates
run "rsft-lr3e-5-t$t" "${base[@]}" --lr 3e-5 --train-layers 4 --max-kept-per-prompt 2
lr=$(python results/preset/choose.py --lr)
run "rsft-layers8-lr$lr-t$t" "${base[@]}" --lr "$lr" --train-layers 8 --max-kept-per-prompt 2
run "rsft-kept4-lr$lr-t$t" "${base[@]}" --lr "$lr" --train-layers 4 --max-kept-per-prompt 4
# the second amendment (README): if none of these learns, phase A once more at T = 0.7
if [ "$(python results/preset/choose.py --learns)" = no ]; then
  run "rsft-kept4-lr$lr-t0.7" --method weight-only --harness "$hstar" --budget 2048 --temperature 0.7 \
      --lr "$lr" --train-layers 4 --max-kept-per-prompt 4
fi
python results/preset/choose.py
