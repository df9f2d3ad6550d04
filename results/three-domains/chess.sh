#!/usr/bin/env bash
# Stage 3 of issue #57's study (results/three-domains/README.md): chess, run in a worktree fixed at the commit
# this checkout had when the worktree was made (../whale-chess; config.json of each run records it), then
# landed here for a commit.
#   bash results/three-domains/chess.sh gate    # the gate search (resumes), then the gate on the weight pool
set -euo pipefail
cd "$(dirname "$0")/../.."
here=$PWD
wt=$(dirname "$here")/whale-chess
[ -d "$wt" ] || git worktree add --detach "$wt" HEAD
echo "chess runs at $(git -C "$wt" rev-parse --short HEAD) in $wt"

land() {  # land SRC TARGET: the record of a finished run (no weights), packed, with its report
  [ -f "$1/summary.json" ] || { echo "unfinished: $1 (run this again to resume it)" >&2; exit 1; }
  mkdir -p "$2"
  for f in config.json summary.json metrics.jsonl harnesses archive archive.zip; do
    if [ -e "$1/$f" ]; then cp -r "$1/$f" "$2/"; fi
  done
  python tools/results.py "$2" --pack
  python tools/report.py "$2"
  echo "landed: $2"
}

case "${1:-}" in
  gate)
    run=results/runs/three-domains-chess/gate-search
    if [ ! -f "$wt/$run/summary.json" ]; then
      if [ -f "$wt/$run/config.json" ]; then
        (cd "$wt" && python whale.py --resume "$run")
      else
        (cd "$wt" && python whale.py --domain chess --method harness-only --seed 0 --budget 1600 \
            --harness-examples 32 --harness-n 2 --candidates 3 --test-split val --test-limit 20 --test-n 2 \
            --val-limit 8 --out "$run")
      fi
    fi
    [ -f "$run/run.zip" ] || land "$wt/$run" "$run"
    (cd "$wt" && python results/three-domains/chess_gate.py domains/chess_h0.py "$run/harnesses/cycle00.py" \
        --limit 100 --n 4 --out results/three-domains/chess-gate.json)
    cp "$wt/results/three-domains/chess-gate.json" results/three-domains/chess-gate.json
    echo "gate: results/three-domains/chess-gate.json (commit it with $run)" ;;
  *) echo "usage: bash results/three-domains/chess.sh gate" >&2; exit 2 ;;
esac
