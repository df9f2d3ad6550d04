"""
What each phase of a run did, read back from its metrics.jsonl (and the archive's summary lines):
the table the console prints when a run ends, the spans curve.png shades, and the top of
report.html. A reader sees at once whether the weights or the harness moved the number.

  phase A   RSFT steps, kept rollouts, trained tokens, validation before -> after
  phase B   iterations, candidates (those racing dropped early and what they cost, merges), what
            the sign test accepted (the candidate, its axis and hypothesis), the search set's
            success of the incumbent before -> after

Only what the run logged is shown: a phase without a validation point after it (a run stopped
in it) has no "after". Left out: per-step detail (metrics.jsonl and the report have it).
"""
from pathlib import Path

from harness_search.harness_archive import read_jsonl  # a line cut by a crash is skipped

# One colour for each phase and each split in every picture of a run (curve.png and report.html's curve)
PHASE_FILL = {"A": "#dbe9f8", "B": "#fde7cf"}  # weights blue, harness search orange
SPLIT_COLOUR = {"val": "#1f77b4", "test_subset": "#2ca02c", "test": "#d62728"}


def joined(split: str) -> bool:
    """Whether a curve draws a split's points as a line: validation and the test subset are scored
    after every phase, so the line between two points is what was measured; the full test split
    only at the start and the end, and a line across the phases between would draw what nobody measured."""
    return split != "test"


def hypotheses(run_dir, cycle: int) -> dict:
    """{candidate: (axis, what it tried)} of the harness phase of this cycle, from its archive: the
    proposer's note (the primitives' swap, an LLM's stated idea), else the harness's docstring line."""
    return {c.get("cand"): (c.get("axis"), c.get("note") or c.get("hypothesis") or "")
            for c in read_jsonl(Path(run_dir) / "archive" / f"phase{cycle:02d}" / "summary.jsonl")}


def phases(run_dir) -> list[dict]:
    """One dict per phase, in order: phase ("A" | "B"), cycle, rollouts_start, rollouts_end, seconds,
    val_before, val_after (None where there is none) and what the phase did (see the docstring)."""
    out, current, last_val, last_rollouts, last_t = [], None, None, 0, 0.0

    def start(phase, cycle):
        return dict(phase=phase, cycle=cycle, rollouts_start=last_rollouts, t_start=last_t, val_before=last_val,
                    val_after=None, steps=0, kept=0, rollouts=0, trained_tokens=0, iterations=0, candidates=0,
                    accepted=[], search_before=None, search_after=None, dropped=0, dropped_rollouts=0, merges=0)

    for e in read_jsonl(Path(run_dir) / "metrics.jsonl"):  # (a line cut by a kill is skipped)
        kind = e.get("event")
        if kind == "rollout_step":
            if current is None or current["phase"] != "A":
                current = start("A", e.get("cycle", 0))
                out.append(current)
            current["steps"] += 1
            for k in ("kept", "trained_tokens"):
                current[k] += e.get(k) or 0
            current["rollouts"] += e.get("step_rollouts") or 0
        elif kind in ("harness_candidate", "harness_iteration"):
            if current is None or current["phase"] != "B":
                current = start("B", e.get("cycle", 0))
                out.append(current)
            if kind == "harness_candidate" and e.get("cand") != "cand_000":
                current["candidates"] += 1
                current["merges"] += e.get("kind") == "merge"
                if e.get("dropped_after"):  # raced and dropped: what it cost is the run's count's step
                    current["dropped"] += 1
                    current["dropped_rollouts"] += e.get("rollouts", last_rollouts) - last_rollouts
            if kind == "harness_iteration":
                current["iterations"] += e.get("iteration", 0) > 0
                if current["search_before"] is None:
                    current["search_before"] = e.get("incumbent_success")
                current["search_after"] = e.get("incumbent_success")
                if e.get("accepted") and e.get("test"):
                    current["accepted"].append(e["test"]["cand"])
        elif kind == "eval" and e.get("split") == "val":
            tag = str(e.get("tag"))
            if current is not None and tag == f"{current['phase']}{current['cycle']}":  # the point after it
                current["val_after"] = e.get("mean")
                current = None
            last_val = e.get("mean")
        last_rollouts = e.get("rollouts", last_rollouts)
        if current is not None:
            current["rollouts_end"] = last_rollouts
            current["seconds"] = round(e.get("t", last_t) - current["t_start"], 1)
        last_t = e.get("t", last_t)
    for p in out:
        p.setdefault("rollouts_end", p["rollouts_start"])
        p.setdefault("seconds", 0.0)
        p.pop("t_start")
        if p["phase"] == "B":  # what it spent: its candidates and second looks, as the run's count moved
            p["rollouts"] = p["rollouts_end"] - p["rollouts_start"]
            about = hypotheses(run_dir, p["cycle"])
            p["accepted"] = [dict(cand=c, axis=about.get(c, (None, ""))[0], hypothesis=about.get(c, (None, ""))[1])
                             for c in p["accepted"]]
    return out


def short(text: str, limit: int = 80) -> str:
    """A note in a table cell: up to its first parenthesis (the primitives' failure counts), cut at a word."""
    text = text.split(" (")[0].strip()
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def what_it_did(p: dict) -> str:
    """One phase in words."""
    if p["phase"] == "A":
        return (f"{plural(p['steps'], 'RSFT step')}: kept {p['kept']} of {p['rollouts']} rollouts, trained on "
                f"{p['trained_tokens']} tokens")
    accepted = "; ".join(f"accepted {a['cand']} ({short(a['hypothesis']) or a['axis']})" for a in p["accepted"])
    search = ("" if p["search_before"] is None else
              f"; search set {p['search_before']:.3f} -> {p['search_after']:.3f}")
    extra = [f"{p.get('dropped')} dropped early, {p.get('dropped_rollouts')} rollouts"] * bool(p.get("dropped")) \
        + [plural(p.get("merges"), "merge")] * bool(p.get("merges"))
    return (f"{plural(p['iterations'], 'iteration')}, {plural(p['candidates'], 'candidate')}"
            f"{' (' + ', '.join(extra) + ')' if extra else ''}; {accepted or 'nothing accepted'}{search}")


def what_did_not_move(rows: list[dict]) -> list[str]:
    """One line for each half that had nothing to work with: phase A without a kept rollout (the
    verifier accepted none: at this scale, nothing to imitate), phase B without an accepted change."""
    out = []
    a = [p for p in rows if p["phase"] == "A"]
    b = [p for p in rows if p["phase"] == "B"]
    if a and not any(p["kept"] for p in a):
        out.append("phase A kept no rollout (the verifier accepted none), so it trained on nothing: at this "
                   "model size the domain's starting harness gives it nothing to imitate")
    if b and not any(p["accepted"] for p in b):
        out.append("phase B accepted no harness change: no candidate beat the incumbent by the sign test")
    return out


def table(run_dir, val_n: int) -> list[str]:
    """The closing table's lines: one per phase, with validation mean@val_n before -> after."""
    def val(x):
        return "  -  " if x is None else f"{x:.3f}"
    lines = [f"  {'phase':<6} {'val mean@' + str(val_n):<15} {'rollouts':>9} {'min':>5}  what it did"]
    rows = phases(run_dir)
    for p in rows:
        lines.append(f"  {p['phase'] + str(p['cycle']):<6} {val(p['val_before']) + ' -> ' + val(p['val_after']):<15} "
                     f"{p['rollouts_end'] - p['rollouts_start']:>9} {p['seconds'] / 60:>5.1f}  {what_it_did(p)}")
    return lines + [f"  note: {x}" for x in what_did_not_move(rows)]
