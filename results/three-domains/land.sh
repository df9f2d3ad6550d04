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
  python tools/report.py "$(dirname "$2")"  # the grid's index.html links it
  echo "landed: $2 (commit it and its grid's index: git add $2 $(dirname "$2")/index.html && git commit -m '...')"
}
