#!/usr/bin/env bash
# The first run's procedure (results/first-run/README.md).
#   bash results/first-run/run.sh time    # the default searchqa run, timed, cold cache
#   bash results/first-run/run.sh int8    # the paired fp32 / int8 validation check (rule 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/whale-first-run}
mkdir -p "$out"
case "${1:-}" in
  time)
    rm -rf "$out/cache" "$out/run"
    WHALE_CACHE=$out/cache /usr/bin/time -v -o "$out/time.txt" python whale.py --domain searchqa --out "$out/run" \
        2>&1 | tee "$out/console.log"
    grep -E "Elapsed|Maximum resident" "$out/time.txt"
    du -sh "$out/run" ;;
  int8)
    for p in fp32 int8; do
      [ -f "$out/val-$p/summary.json" ] || python whale.py --domain searchqa --method eval --test-split val \
          --test-limit 0 --test-n 8 --rollout-precision "$p" --out "$out/val-$p"
    done
    python results/first-run/compare.py "$out/val-fp32" "$out/val-int8" ;;
  *) echo "usage: bash results/first-run/run.sh time|int8" >&2; exit 2 ;;
esac
