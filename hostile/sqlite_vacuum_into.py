"""Attack: write a database file outside scratch with sqlite's VACUUM INTO, which the audit hook never sees.
EXPECT: {"status": "error", "error": "unable to open database", "answer": null, "needs": "landlock"}
EXPECT_WITHOUT_LANDLOCK: {"status": "ok", "error": null, "answer": "written", "pwned": true}
"""
import sqlite3
import threading

# the batch's two rollouts are threads of one interpreter: one at a time, or the second opens the
# file while the first is still writing it ("file is not a database") instead of finding it written
ONE_AT_A_TIME = threading.Lock()


def run(task, llm, tools):
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (a)")
    with ONE_AT_A_TIME:
        try:
            db.execute("VACUUM INTO '/tmp/whale_pwned'")
        except sqlite3.OperationalError as e:
            if "already exists" not in str(e):  # the other rollout of the batch was first
                raise
    return "written"
