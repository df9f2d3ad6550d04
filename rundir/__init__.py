"""rundir/: a run's life on disk: its checks before it starts, its directory, resume, trackers.

- run_setup.py: every command-line mistake found before the loop (one line, exit 2), the run
  directory opened, locked and checked for a resume;
- run_dir.py: what a run directory holds (config.json, metrics.jsonl, checkpoint/, summary.json,
  the archive) and the atomic checkpoint a resume continues from, the eval cache;
- tracking.py: the optional TensorBoard / MLflow / W&B mirror of metrics.jsonl;
- phases.py: what each phase did, read back from metrics.jsonl (the closing table, the curve);
- run_reader.py: a run directory (or its run.zip) read back as someone else's files, for the pages;
- report.py: report.html, one self-contained page of what the run did, from its files alone;
- ddp.py: torchrun data parallelism for phase A (one process: a no-op).

What it promises the method: `run_dir.Run(args, open_run)` is the run (new, or resumed from its
last checkpoint) whose `state` is whatever that checkpoint held, so that a resumed run makes the
same steps the uninterrupted one would (a finished one says so and is left as it is);
a damaged file or a full disk is one line, never a lost run. What it leaves out: what the loop
does with the state (whale.py), how a phase is scored (evaluation.py).
"""
