"""Attack: create a file outside scratch through sqlite's ATTACH DATABASE: sqlite opens it in C, so the audit hook never sees it.
EXPECT: {"status": "error", "error": "unable to open database", "answer": null, "needs": "landlock"}
EXPECT_WITHOUT_LANDLOCK: {"status": "ok", "error": null, "answer": "written", "pwned": true}
"""
import sqlite3


def run(task, llm, tools):
    db = sqlite3.connect(":memory:")  # in memory: nothing for the hook to refuse
    db.execute("ATTACH DATABASE '/tmp/whale_pwned' AS x")
    db.execute("CREATE TABLE IF NOT EXISTS x.t (a)")
    db.commit()
    return "written"
