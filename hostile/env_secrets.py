"""Attack: read secrets (API keys, tokens) from the environment.
EXPECT: {"status": "ok", "error": null, "answer": "HOME,LANG,MALLOC_ARENA_MAX,PATH,PYTHONHASHSEED,TMPDIR"}
"""
import os


def run(task, llm, tools):
    return ",".join(sorted(os.environ))
