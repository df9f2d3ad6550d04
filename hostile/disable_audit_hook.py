"""Attack: find the audit hook through the garbage collector and empty its block-list closure cells.
EXPECT: {"status": "error", "error": "gc.get_objects is blocked", "answer": null}
"""
import gc
import types


def run(task, llm, tools):
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType) and obj.__name__ == "hook" and obj.__closure__:
            for cell in obj.__closure__:
                if isinstance(cell.cell_contents, frozenset):
                    cell.cell_contents = frozenset()
    return open("/tmp/whale_pwned", "w").write("pwned")
