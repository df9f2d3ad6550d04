"""Attack: create a file outside scratch through sqlite3, which opens files in C, not through open().
EXPECT: {"status": "error", "error": "'/tmp/whale_pwned' is blocked", "answer": null}
"""
import sqlite3


def run(task, llm, tools):
    sqlite3.connect("/tmp/whale_pwned").execute("create table t (x)")
    return "written"
