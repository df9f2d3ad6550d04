"""
The suite's own plumbing: under pytest-xdist (.ci/run's slow tier) every test that takes a shared
session run, or looks at the attacks' common target, lands in its group (conftest.py's hook). A
missing group fails nothing by itself; it makes CI build a tiny run twice, or lets two attacks race
on one file. So it is checked here, on the real collection and on a real xdist worker.
"""
import subprocess
import sys

import pytest

from tests.helpers import ROOT, SHARED_RUNS


def test_every_test_of_a_shared_run_or_of_pwned_is_marked_with_its_group():
    class Grab:
        def pytest_collection_finish(self, session):
            self.items = list(session.items)
    grab = Grab()
    assert pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT / "test_whale.py"),
                        str(ROOT / "tests")], plugins=[grab]) == 0
    marked = {item.nodeid: {m.args[0] for m in item.iter_markers("xdist_group")} for item in grab.items}
    for item in grab.items:
        shared = set(getattr(item, "fixturenames", ())) & SHARED_RUNS
        if shared:
            assert marked[item.nodeid] == {min(shared)}, item.nodeid
    assert sum(bool(set(getattr(i, "fixturenames", ())) & SHARED_RUNS) for i in grab.items) >= 10
    assert sum(g == {"pwned"} for g in marked.values()) >= 5


@pytest.mark.slow
def test_an_xdist_worker_sees_the_groups():
    """The marks must be there before xdist's worker reads them (conftest's hook runs tryfirst)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                        "tests/test_sandbox.py", "-k", "without_landlock and read_data_copy"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "read_data_copy]@pwned" in r.stdout, r.stdout[-2000:]
