#!/usr/bin/env bash
# Issue #32 item 2: h0's success on the math WEIGHT POOL (never val or test) at four token caps,
# the measurement behind the cap rule of results/phase-a/README.md. One log per cap; a cap whose
# log already ends with its mean@8 line is skipped, so an interrupted sitting resumes.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/phase-a/math-caps
mkdir -p "$out"
for cap in 48 128 256 384; do
  log=$out/cap$cap.txt
  if grep -q "mean@8" "$log" 2>/dev/null; then echo "done: $log"; continue; fi
  python tools/headroom.py --domain math --only h0 --split weight --limit 64 --n 8 --max-tokens "$cap" \
      --temperature 0.7 --seed 0 > "$log"
  cat "$log"
done
