"""rundir/: a run's life on disk: its checks before it starts, its directory, resume, trackers.

- run_setup.py: every command-line mistake found before the loop (one line, exit 2), the run
  directory opened, locked and checked for a resume;
- run_dir.py: what a run directory holds (config.json, metrics.jsonl, checkpoint/, summary.json,
  the archive) and the atomic checkpoint a resume continues from, the eval cache;
- tracking.py: the optional TensorBoard / MLflow / W&B mirror of metrics.jsonl.

What it promises the method: `open_run(args)` returns a RunDir whose `state` is whatever the
last checkpoint held, so that a resumed run makes the same steps the uninterrupted one would;
a damaged file or a full disk is one line, never a lost run. What it leaves out: what the loop
does with the state (whale.py), how a phase is scored (evaluation.py).
"""
