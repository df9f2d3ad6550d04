#!/usr/bin/env bash
# Chromium screenshots of a run's report.html at 1280 px (issue 70): its top, and its phase B0 section
# (the page cut to that section, the same stylesheet: headless Chromium's screenshot ignores #anchors).
#   bash results/report-screens/shoot.sh RUN_DIR OUT_PREFIX [COMMIT]   # RUN_DIR: a run directory or one with
#   run.zip; COMMIT: render the page with that commit's tools/report.py (a worktree, removed after; e.g. a "before")
set -euo pipefail
cd "$(dirname "$0")/../.."
run=$1 out=$2 tmp=$(mktemp -d) src=$PWD
trap 'rm -rf "$tmp"; [ -z "${3:-}" ] || git worktree remove --force "$tmp-src"' EXIT
[ -z "${3:-}" ] || { git worktree add -q --detach "$tmp-src" "$3"; src=$tmp-src; }
if [ -f "$run/run.zip" ]; then python -m zipfile -e "$run/run.zip" "$tmp/run"; else cp -r "$run" "$tmp/run"; fi
(cd "$src" && python tools/report.py "$tmp/run" > /dev/null)
python - "$tmp/run/report.html" "$tmp/b0.html" <<'PY'
import re, sys
page = open(sys.argv[1]).read()
head = page[:page.index("<body")]
start = page.index('<h2 id="phase-B0"')
end = page.find("<h2", start + 10)
open(sys.argv[2], "w").write(head + "<body>" + page[start:end if end > 0 else None] + "</body></html>")
PY
shot() { chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,"$2" \
           --screenshot="$3" "file://$1" > /dev/null 2>&1; }
shot "$tmp/run/report.html" 1000 "$out-top.png"
shot "$tmp/b0.html" 1400 "$out-b0.png"
echo "$out-top.png $out-b0.png"
