"""Attack: defeat the audit hook (sqlite opens files in C, see past_the_hook), then read another checkout of the repository
(its code and data), which is outside this one and so not covered by the empty mounts.
EXPECT: {"status": "ok", "error": null, "answer": "kernel refused: unable to open", "needs": "landlock"}
EXPECT_WITHOUT_LANDLOCK: {"status": "ok", "error": null, "answer_prefix": "leaked:"}
"""
import sqlite3


def past_the_hook(target, write=False):
    """Open `target` past the audit hook and say what the KERNEL then answered: sqlite opens the
    file of an ATTACH DATABASE in C, so the hook never sees it (a rollout is one thread in a
    process of its own, so the older way past the hook, another rollout thread moving the cwd
    between the hook's check and the kernel's, is gone). Reading: sqlite then reads the file's
    header, which a file that is not a database fails."""
    db = sqlite3.connect(":memory:")  # in memory: nothing for the hook to refuse
    try:
        db.execute("ATTACH DATABASE ? AS x", (target,))
        if write:
            db.execute("CREATE TABLE IF NOT EXISTS x.t (a)")
            db.commit()
            return "leaked:wrote"
        db.execute("SELECT count(*) FROM x.sqlite_master").fetchall()
        return "leaked:read a database"
    except sqlite3.DatabaseError as e:
        if "not a database" in str(e):  # it was opened and its first bytes read
            return "leaked:read its header"
        if "unable to open" in str(e):
            return "kernel refused: unable to open"
        return "other: " + str(e)


def run(task, llm, tools):
    return past_the_hook(task["checkout"] + "/sandbox.py")
