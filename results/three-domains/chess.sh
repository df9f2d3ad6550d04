#!/usr/bin/env bash
# Stage 3 of issue #57's study (results/three-domains/README.md): chess, run in a worktree fixed at the commit
# this checkout had when the worktree was made (../whale-chess; config.json of each run records it), then
# landed here for a commit.
#   bash results/three-domains/chess.sh gate    # the first gate search (resumes), then the gate on the weight pool
#   bash results/three-domains/chess.sh gate2   # the second (sideways moves), in its own worktree ../whale-chess2
#   bash results/three-domains/chess.sh gate3   # the third (racing and merge, issue 67), in ../whale-chess3
set -euo pipefail
cd "$(dirname "$0")/../.."
here=$PWD
case "${1:-}" in gate2|gate3) wt=$(dirname "$here")/whale-chess${1#gate} ;; *) wt=$(dirname "$here")/whale-chess ;; esac
[ -d "$wt" ] || git worktree add --detach "$wt" HEAD
echo "chess runs at $(git -C "$wt" rev-parse --short HEAD) in $wt"

. results/three-domains/land.sh  # land SRC TARGET

gate() {  # gate NAME [FLAGS...]: the gate search NAME-search (resumes), then chess_gate.py into chess-NAME.json
  local name=$1 run=results/runs/three-domains-chess/$1-search
  shift
  if [ ! -f "$wt/$run/summary.json" ]; then
    if [ -f "$wt/$run/config.json" ]; then
      (cd "$wt" && python whale.py --resume "$run")
    else
      (cd "$wt" && python whale.py --domain chess --method harness-only --seed 0 --budget 1600 \
          --harness-examples 32 --harness-n 2 --candidates 3 --test-split val --test-limit 20 --test-n 2 \
          --val-limit 8 "$@" --out "$run")
    fi
  fi
  [ -f "$run/run.zip" ] || land "$wt/$run" "$run"
  (cd "$wt" && python results/three-domains/chess_gate.py domains/chess_h0.py "$run/harnesses/cycle00.py" \
      --limit 100 --n 4 --out "results/three-domains/chess-$name.json")
  cp "$wt/results/three-domains/chess-$name.json" "results/three-domains/chess-$name.json"
  echo "gate: results/three-domains/chess-$name.json (commit it with $run)"
}

case "${1:-}" in
  gate) gate gate ;;
  gate2) gate gate2 --proposer-ties newer ;;
  gate3) gate gate3 --proposer-ties newer ;;  # racing and merge are this commit's defaults
  *) echo "usage: bash results/three-domains/chess.sh gate|gate2|gate3" >&2; exit 2 ;;
esac
