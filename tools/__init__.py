"""tools/: what a user runs beside the method, kept out of the reader's way.

report.py (writes the HTML page of a run, rundir/report.py, or a grid's index), results.py (tables and claims over a grid of runs),
bench.py (speed, as ratios measured side by side), e2e.sh (one whale.py command timed at two
commits), gpu_check.sh (bench and a tiny run on a GPU), headroom.py (h0 against hand-picked
harnesses), race_replay.py (racing's decisions and cost on every archived search) and
reading_path.py (the files and lines one RSFT step and one harness iteration run through). None of
them is part of the algorithm, and nothing the loop runs imports tools/ (a finished run writes its
report.html with rundir/report.py).
"""
