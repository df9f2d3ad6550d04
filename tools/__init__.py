"""tools/: what a user runs beside the method, kept out of the reader's way.

report.py (one HTML page per run), results.py (tables and claims over a grid of runs),
bench.py (speed, as ratios measured side by side), e2e.sh (one whale.py command timed at two
commits), gpu_check.sh (bench and a tiny run on a GPU), headroom.py (h0 against hand-picked
harnesses) and race_replay.py (racing's decisions and cost on every archived search). None of
them is part of the algorithm; a finished run writes its report.html with report.py (the loop's
evaluation.finish calls it: nothing under rundir/ imports tools/).
"""
