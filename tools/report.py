"""
The command that writes report.html for a WHALE run, or index.html for a folder of runs (the page
itself, and what it shows: rundir/report.py).

    python tools/report.py runs/searchqa-whale-s0      # writes runs/searchqa-whale-s0/report.html
    python tools/report.py results/runs/cpu            # a grid: index.html linking every run's report
                                                       # (writes the reports that are missing or stale)
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tools/x.py` imports the repository's modules

from rundir.report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
