"""
exits.py: the two ways a run stops before its loop in one line, raised anywhere below whale.py.

whale.py's main catches them: a UserError (a mistake in the command line or the inputs, a damaged
file, a full disk) prints one line and exits 2; RunFinished (--resume of a finished run) prints
the run's summary and exits 0. A file of its own so that run_setup.py and run_dir.py both raise
them without importing each other.
"""


class UserError(Exception):
    """A mistake in the command line or the inputs: one line, exit code 2."""


class RunFinished(Exception):
    """--resume of a run that has finished: its summary is said (str(e)), nothing on disk changes, exit 0."""
