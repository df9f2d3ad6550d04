# Sourced by run.sh and chess.sh (issue #57's study): land a finished run from its worktree here.
# land SRC TARGET: the record of a finished run (config, metrics, summary, harnesses, archive; no
# weights), packed into TARGET/run.zip with its report.html, ready for a commit. An unfinished run
# is never landed: the script stops, and running it again resumes the run.
land() {
  [ -f "$1/summary.json" ] || { echo "unfinished: $1 (run this again to resume it)" >&2; exit 1; }
  mkdir -p "$2"
  for f in config.json summary.json metrics.jsonl harnesses archive archive.zip; do
    if [ -e "$1/$f" ]; then cp -r "$1/$f" "$2/"; fi
  done
  python tools/results.py "$2" --pack
  python tools/report.py "$2"
  echo "landed: $2 (commit it: git add $2 && git commit -m '...' -- $2)"
}
