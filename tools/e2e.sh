#!/usr/bin/env bash
# End-to-end timing of one whale.py command at two commits (issue #31, item 4), one after the other,
# on a machine with nothing else running. Each commit gets its own worktree and a fresh WHALE_CACHE
# that holds only the converted model (so no evaluation is a cache hit), and /usr/bin/time.
# Prints both wall clocks and peak RSS (the whale.py process), then each run's events with their times,
# so that the same work can be compared: two commits' searches may try other candidates, so the whole
# runs need not match.
#   bash tools/e2e.sh 5485bb5 HEAD                              # the default run, before / after
#   bash tools/e2e.sh 5485bb5 HEAD --method weight-only --budget 512
#   E2E_TOGETHER=1 bash tools/e2e.sh 5485bb5 HEAD FLAGS   # both at once, one thread each, as the grids
#                                                         # run (a long cell: half the wall clock)
# Results go to ${E2E_DIR:-/tmp/whale-e2e}/<commit>/ (run/, run.log); the worktrees are removed after.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: bash tools/e2e.sh COMMIT_A COMMIT_B [whale.py flags]" >&2; exit 2; }
a=$(git rev-parse --short "$1"); b=$(git rev-parse --short "$2"); shift 2
flags=("$@"); [ ${#flags[@]} -gt 0 ] || flags=(--domain searchqa)
root=${E2E_DIR:-/tmp/whale-e2e}
model=$(python -c "from lm import models; print(models.embedded_model_dir())")  # converted once, shared
time_one() {  # COMMIT: its worktree, its fresh cache, its timed run
  local c=$1 d="$root/$1"
  (cd "$d/src" && WHALE_CACHE="$d/cache" /usr/bin/time -f "$c: %e s wall, %U s user, %M KB peak RSS" -o "$d/time.txt" \
     python whale.py "${flags[@]}" --out "$d/run" > "$d/run.log" 2>&1) || { tail -5 "$d/run.log"; return 1; }
}
for c in "$a" "$b"; do
  d="$root/$c"; rm -rf "$d"; mkdir -p "$d/cache"
  ln -s "$model" "$d/cache/"
  git worktree add -q --detach "$d/src" "$c"
done
if [ -n "${E2E_TOGETHER:-}" ]; then
  OMP_NUM_THREADS=1 time_one "$a" & pa=$!
  OMP_NUM_THREADS=1 time_one "$b" & pb=$!
  ok=0; wait "$pa" || ok=1; wait "$pb" || ok=1
else
  ok=0; time_one "$a" && time_one "$b" || ok=1
fi
for c in "$a" "$b"; do git worktree remove --force "$root/$c/src"; done
[ "$ok" = 0 ] || exit 1
cat "$root/$a/time.txt" "$root/$b/time.txt"
for c in "$a" "$b"; do
  echo "== $c: t (s), event, rollouts after it"
  python - "$root/$c/run/metrics.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    what = {"eval": lambda: f"eval {r['split']} {r.get('tag')} {r['examples']}x{r['n']} mean {r['mean']:.4f}",
            "rollout_step": lambda: f"RSFT step, kept {r.get('kept')}",
            "harness_candidate": lambda: f"candidate {r.get('cand')} ({r.get('axis') or 'incoming'}) {r.get('success')}"}
    if r["event"] in what:
        print(f"{r['t']:8.1f}  {what[r['event']]()}  [{r['rollouts']}]")
EOF
done
