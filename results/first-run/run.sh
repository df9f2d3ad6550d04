#!/usr/bin/env bash
# The first run's procedure (results/first-run/README.md).
#   bash results/first-run/run.sh time [DOMAIN]   # the default run (searchqa unless named), timed, cold cache
#   WHALE_FLAGS="--max-memory 4" OUT=/tmp/run-11b bash results/first-run/run.sh time   # with flags of a registered run
#   bash results/first-run/run.sh int8    # the paired fp32 / int8 validation check (rule 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/whale-first-run}
mkdir -p "$out"
case "${1:-}" in
  time)
    domain=${2:-searchqa}
    run=$out/run${2:+-$2}
    rm -rf "$out/cache" "$run"
    WHALE_CACHE=$out/cache /usr/bin/time -v -o "$run.time.txt" python whale.py --domain "$domain" ${WHALE_FLAGS:-} --out "$run" \
        2>&1 | tee "$run.console.log"
    grep -E "Elapsed|Maximum resident" "$run.time.txt"
    du -sh "$run" ;;
  int8)
    for p in fp32 int8; do
      [ -f "$out/val-$p/summary.json" ] || python whale.py --domain searchqa --method eval --test-split val \
          --test-limit 0 --test-n 8 --rollout-precision "$p" --out "$out/val-$p"
    done
    python results/first-run/compare.py "$out/val-fp32" "$out/val-int8" ;;
  *) echo "usage: bash results/first-run/run.sh time|int8" >&2; exit 2 ;;
esac
