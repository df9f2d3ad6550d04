"""domains/: one file per task family (searchqa, math, chess; template.py is the commented
example to copy). Each holds its data splits, tools, verifier, seed harness <name>_h0.py and the
axes the harness search may change (a long menu of them may live in <name>_menu.py).

This file holds what they share: the list of domain names (what --domain accepts), the flag
defaults a domain sets for itself (its DEFAULTS), and the record check every load_split of a data
file runs, so that a data file a fork brings (WHALE_DATA) fails with one clear line at start-up,
not a KeyError in the middle of a run.
"""
from pathlib import Path


def names():
    """The domains: every domains/<name>.py except seed harnesses (<name>_h0.py), search menus
    (<name>_menu.py) and _private files."""
    return sorted(p.stem for p in Path(__file__).parent.glob("*.py")
                  if not p.stem.startswith("_") and not p.stem.endswith(("_h0", "_menu")))


def defaults(name) -> dict:
    """The settings a domain sets for itself (its DEFAULTS dict, e.g. chess's run size): they replace
    whale.Args' defaults for that domain, and a flag on the command line replaces both. {} for a
    domain without DEFAULTS or a name that is not a domain (the command-line check names it)."""
    if name not in names():
        return {}
    import importlib
    try:
        return dict(getattr(importlib.import_module(f"domains.{name}"), "DEFAULTS", {}))
    except Exception:  # a domain file that does not import fails where a run of it imports it, not here
        return {}


def check_records(records, path, task_keys, answer_keys):
    """Raise ValueError naming the first record of `path` that lacks what the domain reads:
    a str "id", a dict "task" with task_keys, a dict "answer" with answer_keys."""
    for n, r in enumerate(records, 1):
        where = f"{path} record {n}"
        if not isinstance(r, dict) or not isinstance(r.get("id"), str):
            raise ValueError(f"{where}: not an object with a str 'id'")
        for part, keys in (("task", task_keys), ("answer", answer_keys)):
            value = r.get(part)
            if not isinstance(value, dict):
                raise ValueError(f"{where} (id {r['id']!r}): no {part!r} object")
            missing = [k for k in keys if k not in value]
            if missing:
                raise ValueError(f"{where} (id {r['id']!r}): {part} has no {', '.join(map(repr, missing))}")
    return records
