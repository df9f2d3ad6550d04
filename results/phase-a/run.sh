#!/usr/bin/env bash
# Issue #32's pre-registered phase-A study (results/phase-a/README.md), searchqa, validation only:
# the test split is never read (--test-split val: "test" numbers are val mean@8 on all 100 x 8).
# Each regime is one weight-only run in results/phase-a/runs/<regime>; a finished run (summary.json)
# is skipped and an interrupted one resumes, so `bash results/phase-a/run.sh` continues the study
# in any sitting. R7, R8 and the seed-1 confirmation C1 are chosen from the earlier runs by study.py,
# by the rules of the README.
#   bash results/phase-a/run.sh            # stage 1 (R1-R6), R7, R8, C1, then math's M1, M3, M4, M2, M5, M6, M7, MC1
#   bash results/phase-a/run.sh R1 R4      # some regimes only
#   bash results/phase-a/run.sh N1         # the newcomer's 16-step run (README, item 5)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/phase-a/runs
# Stage 0's harness H_s: the harness-only search from h0 at the cpu-long settings with the primitives
# proposer as landed when this study was registered (3de839e): the committed cpu-long run, seed 0
# (its incumbent was chosen on the harness split's search set; its test numbers play no part here)
hs=results/runs/cpu-long/searchqa-harness-only-s0/harnesses/cycle00.py
steps=32  # RSFT steps of a stage-1 run (R3: 8 steps 4x larger, the same rollouts; amendment 2026-12-02)
base=(--domain searchqa --method weight-only --seed 0 --test-split val --test-limit 0 --test-n 8
      --val-limit 32 --val-n 2 --val-every 16 --max-tokens 48 --temperature 0.7 --lr 1e-4
      --train-layers 4 --prompts-per-step 16 --group 8 --max-kept-per-prompt 4)
regime() {  # the flags of a regime, on top of base
  case $1 in
    R1) echo "--harness $hs --budget $((steps * 128))" ;;
    R2) echo "--harness $hs --budget $((steps * 128)) --temperature 1.0" ;;
    R3) echo "--harness $hs --budget $((steps * 128)) --prompts-per-step 64" ;;
    R4) echo "--harness $hs --budget $((steps * 128)) --replay-steps 4 --sft-epochs 4" ;;
    R5) echo "--harness $hs --budget $((steps * 128)) --max-kept-per-prompt 0" ;;
    R6) echo "--harness $hs --budget $((steps * 128)) --train-layers 0 --lr 1e-5" ;;
    # length and start harness: the stage-1 regime with the largest val gain, for 64 steps (study.py --best)
    R7|R8) best=$(python results/phase-a/study.py --best "$out")
           flags=$(regime "$best" | sed "s/--budget [0-9]*//; s/--harness [^ ]*//")
           h=$hs; [ "$1" = R8 ] && h=$(python -c "import domains.searchqa as d; print(d.H0)")
           echo "--harness $h --budget $((64 * 128)) $flags" ;;  # (study.py never picks R3 here)
    # the confirmation: the learning regime with the largest gain, again at seed 1 (study.py --confirm)
    C1) best=$(python results/phase-a/study.py --confirm "$out")
        [ -n "$best" ] || { echo "no regime learns: nothing to confirm" >&2; return 1; }
        echo "$(regime "$best") --seed 1" ;;
    # the newcomer's run (item 5): R6 for 16 steps with a val point every 8, at the commit that adds it
    N1) echo "$(regime R6 | sed "s/--budget [0-9]*//") --budget $((16 * 128)) --val-every 8" ;;
    # math (item 2): R1, R3 and R4 from math's h0 at the cap the README's rule chose (48); the other
    # regimes (M2, M5, M6) only if one of these learns (M1 did: README, 2026-12-03)
    M[1-6]) echo "$(regime "R${1#M}" | sed "s/--harness [^ ]*//") --domain math --max-tokens 48" ;;
    # then math's length run and confirmation, chosen as R7 and C1 are, among M1-M6 (M7) and M1-M7 (MC1)
    M7) best=$(python results/phase-a/study.py --best --math "$out")
        echo "$(regime "$best" | sed "s/--budget [0-9]*//") --budget $((64 * 128))" ;;
    MC1) best=$(python results/phase-a/study.py --confirm --math "$out")
         [ -n "$best" ] || { echo "no math regime learns: nothing to confirm" >&2; return 1; }
         echo "$(regime "$best") --seed 1" ;;
    *) echo "unknown regime $1 (R1-R8, C1, N1, M1-M7, MC1)" >&2; exit 2 ;;
  esac
}
for r in ${*:-R1 R2 R3 R4 R5 R6 R7 R8 C1 M1 M3 M4 M2 M5 M6 M7 MC1}; do
  dir=$out/$r
  if [ -f "$dir/summary.json" ]; then echo "done: $dir"; continue; fi
  if [ -f "$dir/config.json" ]; then
    python whale.py --resume "$dir"
  else
    spec=$(regime "$r") || { echo "skipped: $r"; continue; }  # (C1 when no regime learns)
    read -ra flags <<< "$spec"
    python whale.py "${base[@]}" "${flags[@]}" --out "$dir"
  fi
  python tools/results.py "$dir" --pack   # drop the archive's bulk as the grids do
  python results/phase-a/study.py "$out" --readme results/phase-a/README.md
done
