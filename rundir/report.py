"""
report.py: one self-contained HTML page per WHALE run, to look at what the run did. A finished
run writes its own (evaluation.finish); the command is tools/report.py:

    python tools/report.py runs/searchqa-whale-s0      # writes runs/searchqa-whale-s0/report.html
    python tools/report.py results/runs/cpu            # a grid: index.html linking every run's report
                                                 # (writes the reports that are missing or stale)

The page follows the run's order:
  summary      method, domain, seed, budget, test mean@k initial / final / best-on-validation /
               best-on-test with 95% intervals, the paired gain, and an SVG curve of every
               evaluation against target rollouts with the phases shaded;
  phase A      one row per RSFT step: training reward, kept rollouts, trained tokens, loss;
  phase B      per iteration: the paper's choice (the archive's top scorer), the run's
               acceptance test (paired sign test against the incumbent: better / worse
               counts, p, accepted or not), and per candidate its proposer, note,
               hypothesis (its docstring's first line), how the primitives proposer made it
               (kind, axes, parents), validation outcome, search-set score, the same paired
               test against the incumbent, its change as a highlighted diff against its
               parent, and two failed and one successful trace (collapsed <details>);
  final        the harness the run ended with (or holds now, if it is still running), in full.

Everything the page shows comes from the run directory (run_dir.py and harness_archive.py describe
it) through rundir/run_reader.py (read_run, read_traces), the one file that knows the run's file
names and reads them as someone else's files; a committed run's run.zip the same way. The page and
the readers tolerate missing and extra fields: old runs, runs in progress, resumed runs, runs whose traces
were not kept (the cpu grid's runs were committed without traces.jsonl; the page says so).
Fields the page does not know are listed as "other fields", so new ones show up.

The page is one file with inline CSS and inline SVG and no script at all; a Content-Security-
Policy forbids every network load, so it opens from disk anywhere. Every text from the run
(model output, harness code, proposer replies) is HTML-escaped, and long texts are cut with
a visible marker.

Left out: interactivity (sorting, filtering, search: the browser's find works), plots other
than the one curve, the Pareto frontier as a plot (it is listed), comparing runs (results.py
does that), and reading the model checkpoints.
"""
import argparse
import difflib
import html
import json
import math
import os
import re
import sys
import urllib.parse
from pathlib import Path

# the run's own acceptance test (meta_harness needs only the standard library)
from harness_search.harness_source import hypothesis
from jail import received  # a path the run names is checked to stay inside it
from meta_harness import sign_test
from rundir.phases import PHASE_FILL, SPLIT_COLOUR, joined  # the colours curve.png uses too
from rundir.run_reader import (BadRun, as_dict, find_runs, is_run_dir, read_run,  # the run's files
                               read_traces, run_files_mtime)

HERE = Path(__file__).resolve().parents[1]  # the repository root
PASS = 0.5  # a rollout "succeeds" when its verifier score is above this (rs_sft.py keeps the same ones)


# -----------------------------------------------------------------------------
# Small formatting helpers (every text from the run goes through esc or clip)


def esc(x):
    return html.escape(str(x), quote=True)


def clip(text, limit=2000):
    """Escaped text, cut after `limit` characters with a visible marker."""
    text = "" if text is None else str(text)
    if len(text) <= limit:
        return esc(text)
    return esc(text[:limit]) + f'<span class="cut">[… {len(text) - limit:,} more characters not shown]</span>'


def num(x, digits=3):
    if isinstance(x, bool) or x is None:
        return "–" if x is None else str(x)
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{digits}f}"
    return esc(x)


def mean_ci(mean, se, lo=0.0, hi=1.0):
    """'0.133 ± 0.022 [0.089, 0.177]': mean ± standard error, then the normal 95% interval
    (clipped to [lo, hi], the range a score can take)."""
    if not isinstance(mean, (int, float)):
        return "–"
    if not isinstance(se, (int, float)):
        return f"{mean:.3f}"
    return (f"{mean:+.3f} ± {se:.3f}" if lo < 0 else f"{mean:.3f} ± {se:.3f}") + \
        f" <span class=dim>[{max(lo, mean - 1.96 * se):.3f}, {min(hi, mean + 1.96 * se):.3f}]</span>"


def mean_se(mean, se, signed=False):
    if not isinstance(mean, (int, float)):
        return "–"
    return (f"{mean:+.3f}" if signed else f"{mean:.3f}") + (f" ± {se:.3f}" if isinstance(se, (int, float)) else "")


def kv_table(rows):
    return "<table class=kv>" + "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def extras(d, known):
    """Fields of a record the page does not render otherwise (and that hold something), collapsed."""
    rest = {k: v for k, v in (d or {}).items() if k not in known and v not in (None, "", [], {})}
    if not rest:
        return ""
    return (f'<details class="extra"><summary>{len(rest)} more field{"s" * (len(rest) != 1)}: '
            f'{esc(", ".join(sorted(rest))[:200])}</summary><pre>{clip(json.dumps(rest, indent=1, default=str), 2000)}'
            '</pre></details>')


def badge(text, kind):
    return f'<span class="badge {kind}">{esc(text)}</span>'


# -----------------------------------------------------------------------------
# What the run did, in order: sections of the timeline and the phases' spans on the curve


def timeline(metrics):
    """metrics.jsonl -> [section]: 'initial' (evaluations before any phase), then one 'A' or
    'B' section per phase in run order, each with its rows and the evaluations after it."""
    sections = [dict(kind="initial", cycle=None, rows=[], evals=[])]
    for row in metrics:
        event = row.get("event")
        if not (row.get("cycle") is None or type(row.get("cycle")) is int):
            row = dict(row, cycle=None)  # (a received file's field goes into ids and titles below)
        if event in ("rollout_step", "harness_iteration"):
            kind = "A" if event == "rollout_step" else "B"
            last = sections[-1]
            same = last["kind"] == kind and last["cycle"] == row.get("cycle")
            if not same or last["evals"]:  # (after a --val-every evaluation: the same phase, continued)
                sections.append(dict(kind=kind, cycle=row.get("cycle"), rows=[], evals=[], continued=same))
            sections[-1]["rows"].append(row)
        elif event == "eval":
            sections[-1]["evals"].append(row)
        elif event != "start":
            sections[-1].setdefault("other", []).append(row)
    return sections if sections[0]["evals"] or len(sections) > 1 else []


def phase_spans(sections, phases):
    """[(kind, cycle, start, end, in_progress)] in target rollouts, for the curve's shading.
    A phase-A step covers its own rollouts; a harness phase is logged when it ends, so it covers
    the rollouts since the phase before it. A harness phase still running (in the archive, not
    yet in metrics.jsonl) covers the rollouts its archive has booked so far."""
    spans, end = [], 0
    for s in sections:
        if s["kind"] not in ("A", "B") or not s["rows"]:
            continue
        last = max(int(r.get("rollouts") or 0) for r in s["rows"])
        start = end
        if s["kind"] == "A":
            first = s["rows"][0]
            start = int(first.get("rollouts") or 0) - int(first.get("step_rollouts") or 0)
        spans.append((s["kind"], s["cycle"], start, last, False))
        end = last
    logged = {s["cycle"] for s in sections if s["kind"] == "B"}
    for p in phases:
        if p["cycle"] not in logged:
            spent = sum(int(as_dict(line.get("cost")).get("rollouts") or 0) for line in p["summary"])
            spans.append(("B", p["cycle"], end, end + spent, True))
            end += spent
    return spans


def final_harness(run):
    """(source, where it comes from): the checkpoint's current harness, else the last accepted
    one in harnesses/, else the starting harness named in config.json when it is a file inside
    the run, else the domain's h0 in this checkout. A path config.json names outside the run (an
    absolute one, ../) is never opened: the page says so instead."""
    state = run["state"] or {}
    if isinstance(state.get("harness"), str):
        return state["harness"], "checkpoint/state.json (the harness the run holds now)"
    if run["harnesses"]:
        name = sorted(run["harnesses"])[-1]
        return run["harnesses"][name], f"harnesses/{name} (the harness of the run's last harness phase)"
    cfg = run["config"]
    named = cfg.get("harness")
    if named:
        try:
            path = received.inside(run["record"], str(named))
        except ValueError:
            return None, (f"{named} (the --harness file the run started from; outside the run directory, "
                          "so not opened)")
        source = read_text(path, None, root=run["record"])
        if source is not None:
            return source, f"{named} (the --harness file the run started from: the run never changed its harness)"
    domain = str(cfg.get("domain", ""))
    h0 = HERE / "domains" / f"{domain}_h0.py"
    if re.fullmatch(r"[a-z][a-z0-9_]*", domain) and h0.is_file():
        return h0.read_text(), f"domains/{domain}_h0.py (the domain's seed harness, as it is in this checkout)"
    return None, "not found"


# -----------------------------------------------------------------------------
# Sections of the page


def render_header(run, sections):
    cfg, summary, metrics = run["config"], run["summary"], run["metrics"]
    title = f"{cfg.get('method', '?')} on {cfg.get('domain', '?')}, seed {cfg.get('seed', '?')}"
    starts = [r for r in metrics if r.get("event") == "start"]
    notes = []
    if summary is None:
        state = run["state"] or {}
        notes.append(badge("in progress or stopped", "warn") +
                     f" no summary.json yet: the numbers come from metrics.jsonl"
                     f"{' and checkpoint/state.json' if run['state'] else ''}"
                     + (f" (phase {esc(state.get('phase'))}, cycle {esc(state.get('cycle'))}, "
                        f"{esc(state.get('rollouts'))} rollouts)" if state else "")
                     + (f"; last line logged at t = {num(metrics[-1].get('t'), 0)} s" if metrics else "")
                     + f". Continue it with <code>python whale.py --resume {esc(run['dir'])}</code>.")
    else:
        notes.append(badge("finished", "ok"))
    if len(starts) > 1:
        notes.append(badge(f"resumed {len(starts) - 1}×", "warn") + " process starts: " + ", ".join(
            f"t={num(s.get('t'), 0)} s at {esc(s.get('rollouts'))} rollouts ({esc(str(s.get('commit', '?'))[:12])})"
            for s in starts))
    elif starts:
        notes.append(f"code: commit {esc(starts[0].get('commit', '?'))}")
    evaluated = [c for p in run["phases"] for c in p["candidates"] if c["scores"]]
    without = [c for c in evaluated if not c["has_traces"]]
    if without:
        notes.append(badge("traces not kept", "warn") + (
            f" {len(without)} of {len(evaluated)} evaluated candidates have no traces.jsonl"
            " (runs committed under results/ are kept without them: git ignores traces.jsonl), so the"
            " page shows no rollout traces for them."))
    toc = ['<a href="#summary">summary</a>', '<a href="#curve">curve</a>']
    for s in (s for s in sections[1:] if not s.get("continued")):
        toc.append(f'<a href="#phase-{esc(s["kind"])}{esc(s["cycle"])}">phase {esc(s["kind"])}{esc(s["cycle"])}</a>')
    logged = {s["cycle"] for s in sections if s["kind"] == "B"}
    toc += [f'<a href="#phase-B{esc(p["cycle"])}">phase B{esc(p["cycle"])} (in progress)</a>'
            for p in run["phases"] if p["cycle"] not in logged]
    toc.append('<a href="#final">final harness</a>')
    return (f"<h1>{esc(title)}</h1><p class=dim>{esc(run['dir'])}</p>"
            + "".join(f"<p>{n}</p>" for n in notes) + "<nav>" + " · ".join(toc) + "</nav>")


def render_summary(run):
    cfg, s, metrics = run["config"], run["summary"] or {}, run["metrics"]
    tests = [r for r in metrics if r.get("event") == "eval" and r.get("split") == "test"]
    by_tag = {r.get("tag"): r for r in tests}
    k = s.get("test_n") or cfg.get("test_n") or (tests[0].get("n") if tests else "k")

    def point(key, tag):  # summary.json when there is one, else the evaluation in metrics.jsonl
        if key in s:
            return s.get(key), s.get(key + "_se")
        r = by_tag.get(tag) or {}
        return r.get("mean"), r.get("se")
    rollouts = s.get("rollouts", max([int(r.get("rollouts") or 0) for r in metrics] + [0]))
    rows = [("method", esc(cfg.get("method", s.get("method", "?")))), ("domain", esc(cfg.get("domain", "?"))),
            ("seed", esc(cfg.get("seed", "?"))), ("model", esc(cfg.get("model", s.get("model", "?")))),
            ("schedule", esc(cfg.get("schedule", "?"))), ("proposer", esc(cfg.get("proposer", "?"))),
            ("budget", f"{esc(rollouts)} of {esc(cfg.get('budget', s.get('budget', '?')))} target rollouts spent"),
            ("phases", f"{esc(s.get('steps', sum(r.get('event') == 'rollout_step' for r in metrics)))} RSFT steps, "
                       f"{len(run['phases'])} harness phase(s)"),
            ("time", f"{s['seconds'] / 60:.1f} min" if isinstance(s.get("seconds"), (int, float)) else "–"),
            ("tokens", f"{esc(s.get('prompt_tokens', '–'))} prompt, "
                       f"{esc(s.get('completion_tokens', '–'))} completion; "
                       f"proposer calls {esc(s.get('proposer_calls', '–'))}")]
    n_q = s.get("test_examples") or (tests[0].get("examples") if tests else "?")
    score_rows = [("initial (base model, h0)", mean_ci(*point("test_mean8_initial", "initial"))),
                  ("final", mean_ci(*point("test_mean8_final", "final"))),
                  ("best on validation", mean_ci(*point("test_mean8_best_val", "best_val"))),
                  ("best on test (the paper's metric, selected on test)", mean_ci(*point("test_mean8_best_test", "-")))]
    if "test_gain" in s:
        score_rows.append(("gain final − initial (paired over the same questions)",
                           mean_ci(s["test_gain"], s.get("test_gain_se"), lo=-1.0)))
    return ('<h2 id="summary">Summary</h2>' + kv_table(rows) +
            f"<h3>Test mean@{esc(k)} on {esc(n_q)} questions (± SE [95% interval])</h3>" + kv_table(score_rows) +
            render_two_by_two(s.get("test_2x2")) + render_phase_table(s.get("phases"), cfg.get("val_n", "k")))


def render_two_by_two(c):
    """summary.json's test_2x2 (evaluation.two_by_two): the four cells, and what each half did."""
    if not isinstance(c, dict):
        return ""
    cells = (f"<table><tr><th></th><th>starting harness</th><th>final harness</th></tr>"
             f"<tr><td>base weights</td><td>{num(c.get('base_h0'))}</td><td>{num(c.get('base_weights_final_harness'))}</td></tr>"
             f"<tr><td>final weights</td><td>{num(c.get('final_weights_h0'))}</td><td>{num(c.get('final'))}</td></tr></table>")
    effects = kv_table([(name, mean_ci(c.get(key), c.get(key + "_se"), lo=-1.0)) for name, key in (
        ("the weights alone", "weights_alone"), ("the harness alone", "harness_alone"), ("together", "together"),
        ("together beyond the two alone (interaction)", "interaction"))])
    return (f"<h3>Which half moved the number: the 2 × 2 on the same {esc(c.get('questions'))} questions</h3>"
            + cells + effects)


def render_phase_table(phase_rows, val_n):
    """What each phase did (summary.json's phases, rundir/phases.py): the table the console printed."""
    if not phase_rows:
        return ""
    from rundir.phases import what_it_did

    def val(x):
        return "–" if x is None else f"{x:.3f}"
    rows = "".join(f"<tr><td>{esc(p['phase'])}{esc(p['cycle'])}</td><td>{val(p.get('val_before'))} → "
                   f"{val(p.get('val_after'))}</td><td>{esc(p['rollouts_end'] - p['rollouts_start'])}</td>"
                   f"<td>{p.get('seconds', 0) / 60:.1f}</td><td>{esc(what_it_did(p))}</td></tr>" for p in phase_rows)
    return (f"<h3>What each phase did</h3><table><tr><th>phase</th><th>val mean@{esc(val_n)}</th><th>rollouts</th>"
            f"<th>min</th><th>what it did</th></tr>{rows}</table>")


def render_curve(run, sections):
    """Inline SVG: every evaluation's mean ± SE against cumulative target rollouts, one line per
    split, phase A spans shaded blue and phase B spans orange."""
    evals = [r for r in run["metrics"] if r.get("event") == "eval" and isinstance(r.get("mean"), (int, float))]
    spans = phase_spans(sections, run["phases"])
    if not evals and not spans:
        return '<h2 id="curve">Curve</h2><p>No evaluation yet.</p>'
    W, H, L, R, T, B = 760, 320, 56, 150, 16, 42
    x_max = max([int(run["config"].get("budget") or 0)] + [int(r.get("rollouts") or 0) for r in evals] +
                [s[3] for s in spans] + [1])
    y_top = max([r["mean"] + (r.get("se") or 0) for r in evals] + [0.05])
    y_max = math.ceil(y_top * 20) / 20  # the next multiple of 0.05

    def X(v):
        return L + (W - L - R) * v / x_max

    def Y(v):
        return T + (H - T - B) * (1 - v / y_max)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           f'role="img" aria-label="score against target rollouts">']
    for kind, cycle, a, b, running in spans:
        fill = PHASE_FILL[kind]
        out.append(f'<rect x="{X(a):.1f}" y="{T}" width="{max(1.0, X(b) - X(a)):.1f}" height="{H - T - B}" '
                   f'fill="{fill}"><title>phase {esc(kind)}{esc(cycle)}: rollouts {esc(a)}–{esc(b)}'
                   f'{" (in progress)" if running else ""}</title></rect>')
        out.append(f'<text x="{(X(a) + X(b)) / 2:.1f}" y="{T + 12}" class="band">{kind}{esc(cycle)}</text>')
    for i in range(6):  # axes and grid
        yv = y_max * i / 5
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{Y(yv):.1f}" y2="{Y(yv):.1f}" class="grid"/>'
                   f'<text x="{L - 6}" y="{Y(yv) + 4:.1f}" class="tick" text-anchor="end">{yv:.2f}</text>')
    step = nice_step(x_max)
    for i in range(int(x_max // step) + 1):
        out.append(f'<text x="{X(i * step):.1f}" y="{H - B + 16}" class="tick" '
                   f'text-anchor="middle">{i * step:g}</text>')
    out.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#888"/>'
               f'<text x="{(L + W - R) / 2}" y="{H - 6}" class="tick" text-anchor="middle">target rollouts</text>'
               f'<text x="14" y="{(T + H - B) / 2}" class="tick" text-anchor="middle" '
               f'transform="rotate(-90 14 {(T + H - B) / 2})">mean@k</text>')
    colors = SPLIT_COLOUR
    legend_y = T + 10
    for split in sorted({r.get("split") for r in evals}, key=lambda s: list(colors).index(s) if s in colors else 9):
        pts = [r for r in evals if r.get("split") == split]
        color = colors.get(split, "#555")
        path = " ".join(f"{X(int(r.get('rollouts') or 0)):.1f},{Y(r['mean']):.1f}" for r in pts)
        if joined(split):  # (the full test only at the start and the end: points, no line across)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for r in pts:
            x, se = X(int(r.get("rollouts") or 0)), r.get("se") or 0
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{Y(max(0, r["mean"] - se)):.1f}" '
                       f'y2="{Y(min(y_max, r["mean"] + se)):.1f}" stroke="{color}"/>'
                       f'<circle cx="{x:.1f}" cy="{Y(r["mean"]):.1f}" r="3.5" fill="{color}"><title>'
                       f'{esc(split)} {esc(r.get("tag"))} at {esc(r.get("rollouts"))} rollouts: {r["mean"]:.3f} ± '
                       f'{se:.3f} ({esc(r.get("examples"))} questions × {esc(r.get("n"))})</title></circle>')
        n = pts[0].get("n")
        out.append(f'<line x1="{W - R + 12}" x2="{W - R + 30}" y1="{legend_y}" y2="{legend_y}" stroke="{color}" '
                   f'stroke-width="3"/><text x="{W - R + 34}" y="{legend_y + 4}" class="tick">{esc(split)} '
                   f'mean@{esc(n)}{"" if joined(split) else " (ends)"}</text>')
        legend_y += 18
    for kind, fill in PHASE_FILL.items():
        out.append(f'<rect x="{W - R + 12}" y="{legend_y - 6}" width="18" height="10" fill="{fill}"/>'
                   f'<text x="{W - R + 34}" y="{legend_y + 4}" class="tick">phase {kind}</text>')
        legend_y += 18
    out.append("</svg>")
    return ('<h2 id="curve">Curve</h2><p class=dim>Each point: mean ± SE after a phase (hover for details); '
            'phase A (weights) shaded blue, phase B (harness search) orange; the full test split is scored at '
            'the start and the end only, so its points are not joined.</p>' + "".join(out))


def nice_step(span, ticks=5):
    """A round tick spacing (1, 2, 2.5 or 5 times a power of ten) giving about `ticks` ticks."""
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def render_event(r):
    """One line for an event of metrics.jsonl that is not a step, an iteration or an evaluation;
    None for one the page shows elsewhere (a candidate: its card) or does not know."""
    e = r.get("event")
    if e == "harness_candidate":
        return ""  # the iteration's card of that candidate says it all
    if e == "harness_phase_end":
        last = r.get("iterations") - 1 if isinstance(r.get("iterations"), int) else "?"  # iteration 0 is the incoming harness
        return (f'<p>Phase B ended ({esc(r.get("reason"))}) after iteration {esc(last)}; incumbent '
                f'<b>{esc(r.get("incumbent"))}</b> (success {num(r.get("incumbent_success"))}).</p>')
    if e == "two_by_two":
        return (f'<p>2 × 2: {esc(str(r.get("cell")).replace("_", " "))} scored {num(r.get("mean"))} on the test questions '
                f'(the summary\'s table)</p>')
    if e == "memory_fit":
        if not r.get("max_memory_gb"):  # auto, and the model needs more than its 4 GB: no limit
            return (f'<p>{badge("memory", "info")} --max-memory auto: no limit (the model needs about '
                    f'{num(r.get("reserved_gb"), 1)} GB before its rollouts)</p>')
        short = " (the smallest caps: the run needs more)" if r.get("too_small") else ""
        return (f'<p>{badge("memory", "info")} --max-memory {num(r.get("max_memory_gb"), 1)} GB: sampler batches of at '
                f'most {esc(r.get("max_cache_positions"))} cache positions, prefill forwards of at most '
                f'{esc(r.get("max_prefill_tokens"))}, training forwards of at most '
                f'{esc(r.get("max_forward_tokens"))}{short}</p>')
    if e == "health_warning":
        return f'<p>{badge("warning", "warn")} step {esc(r.get("step"))}: {clip(r.get("warning"), 400)}</p>'
    if e in ("archive_integrity", "proposer_error"):
        what = "integrity" if e == "archive_integrity" else "proposer error"
        return f'<p>{badge(what, "no")} {clip(r.get("reason"), 400)}</p>'
    if e == "proposer_backoff":
        return (f'<p>{badge("waited", "info")} {num(r.get("seconds"), 0)} s after {esc(r.get("failed_calls"))} failed '
                'proposer calls</p>')
    return None


def render_other(section):
    """The section's other events: each one this page knows as a line, the ones it does not
    (metrics.jsonl lines of a newer WHALE) together in one collapsed element."""
    rows = (section or {}).get("other", [])
    lines = [render_event(r) for r in rows]
    unknown = [r for r, line in zip(rows, lines) if line is None]
    out = "".join(line for line in lines if line)
    if unknown:
        names = sorted({str(r.get("event")) for r in unknown})
        out += (f'<details class="extra"><summary>{len(unknown)} other event{"s" * (len(unknown) != 1)}: '
                f'{esc(", ".join(names)[:200])}</summary>'
                + "".join(f"<pre>{clip(json.dumps(r, default=str), 600)}</pre>" for r in unknown) + "</details>")
    return out


def render_evals(evals):
    if not evals:
        return ""
    rows = "".join(f"<tr><td>{esc(r.get('split'))}</td><td>{esc(r.get('tag'))}</td><td>{esc(r.get('rollouts'))}</td>"
                   f"<td>{esc(r.get('examples'))} × {esc(r.get('n'))}</td>"
                   f"<td>{mean_ci(r.get('mean'), r.get('se'))}</td></tr>"
                   for r in evals)
    return ("<table><tr><th>evaluation</th><th>after</th><th>rollouts</th><th>questions × samples</th>"
            f"<th>mean ± SE [95%]</th></tr>{rows}</table>")


A_COLUMNS = [("step", "step", 0), ("rollouts", "rollouts", 0), ("train_reward", "training reward", 3),
             ("kept", "kept rollouts", 0), ("kept_frac", "kept share", 3), ("sequences", "sequences", 0),
             ("trained_tokens", "trained tokens", 0), ("sft_tokens", "sequence tokens", 0),
             ("sft_forward_tokens", "tokens run (shared prompts once)", 0),
             ("loss", "loss", 4), ("grad_norm", "grad norm", 3),
             ("opt_steps", "optimizer steps", 0), ("errors", "errors", 0),
             ("capped_frac", "capped share", 3), ("kept_nll_before", "kept NLL before", 3),
             ("kept_nll_after", "kept NLL after", 3), ("peak_rss_mb", "peak RSS so far (MB)", 0)]
MACHINE_FIELDS = {"t", "rss_mb", "peak_rss_mb", "peak_tree_mb"}  # on every line: the machine's clock and memory
A_KNOWN = {c for c, _, _ in A_COLUMNS} | MACHINE_FIELDS | {
    "event", "cycle", "prompts", "skipped_update", "sft_tokens_per_s", "sft_seconds", "rollout_seconds", "epoch",
    "prompt_tokens", "completion_tokens", "step_rollouts", "health_seconds", "replay_sequences"}


def render_phase_a(section):
    head = "".join(f"<th>{esc(label)}</th>" for _, label, _ in A_COLUMNS) + "<th>seconds</th><th>update</th>"
    body = []
    for r in section["rows"]:
        cells = "".join(f"<td>{num(r.get(c), d) if d else esc(r.get(c, '–'))}</td>" for c, _, d in A_COLUMNS)
        secs = sum(v for v in (r.get("rollout_seconds"), r.get("sft_seconds"), r.get("health_seconds"))
                   if isinstance(v, (int, float)))
        update = badge("skipped", "warn") if r.get("skipped_update") else "done" if "skipped_update" in r else "–"
        body.append(f"<tr>{cells}<td>{secs:.0f}</td><td>{update}</td></tr>"
                    f"{_extra_row(r, A_KNOWN, len(A_COLUMNS) + 2)}")
    if section.get("continued"):
        title = f'<h2>Phase A, cycle {esc(section["cycle"])}, continued ({len(section["rows"])} steps)</h2>'
    else:
        title = (f'<h2 id="phase-A{esc(section["cycle"])}">Phase A, cycle {esc(section["cycle"])}: rejection-sampling '
                 f'fine-tuning ({len(section["rows"])} steps)</h2>')
    return (f'{title}<table class=num><tr>{head}</tr>{"".join(body)}</table>'
            + render_other(section) + render_evals(section["evals"]))


def _extra_row(d, known, span):
    e = extras(d, known)
    return f'<tr><td colspan="{span}">{e}</td></tr>' if e else ""


def render_phase_b(section, phase, run):
    cycle = section["cycle"] if section else phase["cycle"]
    running = section is None
    title = (f'<h2 id="phase-B{esc(cycle)}">Phase B, cycle {esc(cycle)}: harness search'
             f'{" " + badge("in progress", "warn") if running else ""}</h2>')
    if phase is None:  # logged in metrics.jsonl, but the archive is not there
        return (title + "<p>The archive of this phase is missing; its iterations as logged:</p>" +
                "".join(f"<pre>{clip(json.dumps(r, default=str), 1500)}</pre>" for r in section["rows"])
                + render_evals(section["evals"]))
    cfg, rules = run["config"], phase["rules"]
    axes = rules.get("allowed_axes")
    front = phase["frontier"].get("success_vs_turns") or []
    proposed = sum(c["name"] != "cand_000" for c in phase["candidates"])  # (cand_000: the incoming harness)
    intro = (f"<p>archive <code>{esc(Path(phase['dir']).name)}</code>: the incoming harness cand_000 and "
             f"{proposed} candidate{'' if proposed == 1 else 's'}, "
             f"{esc(rules.get('k', cfg.get('candidates', '?')))} per iteration, search set "
             f"{esc(cfg.get('harness_examples', '?'))} examples × {esc(cfg.get('harness_n', '?'))}; "
             + (f"prompt-only search: only {esc(', '.join(axes))} may change; " if axes else "")
             + f"acceptance: one-sided paired sign test at α = {esc(cfg.get('accept_alpha', '?'))}. "
             + (f"Pareto frontier (success vs turns): {esc(', '.join(str(p.get('cand')) for p in front))}."
                if front else "")
             + "</p>")
    by_name = {c["name"]: c for c in phase["candidates"]}
    iterations = {r.get("iteration"): r for r in phase["iterations"]}
    numbers = sorted({c["meta"].get("iteration") for c in phase["candidates"]
                      if isinstance(c["meta"].get("iteration"), int)}
                     | {i for i in iterations if isinstance(i, int)})
    parts = [title, intro]
    incumbent = "cand_000"
    run_tests = {}  # candidate -> the run's tests of it: a paper's choice can be tested in later iterations too
    for line in phase["iterations"]:
        if isinstance(line.get("test"), dict):
            run_tests.setdefault(line["test"].get("cand"), []).append((line.get("iteration"), line["test"],
                                                                        bool(line.get("accepted"))))
    for it in numbers:
        line = iterations.get(it)
        members = [c for c in phase["candidates"] if c["meta"].get("iteration") == it]
        parts.append(render_iteration(it, line, members, by_name, incumbent, run_tests))
        if line and line.get("incumbent"):
            incumbent = line["incumbent"]
    if section:
        parts.append(render_other(section) + render_evals(section["evals"]))
    return "".join(parts)


ITER_KNOWN = {"iteration", "cands", "iteration_best", "paper_choice", "paper_success", "paper_mean_turns",
              "test", "accepted", "incumbent", "incumbent_success", "proposer_errors", "cost",
              "archive_best",  # (paper_success under a second name: the runs before 2026-12-07 wrote both)
              "event", "cycle", "rollouts", "integrity", "confirm_rollouts"} | MACHINE_FIELDS


def second_look(confirm, rollouts):
    """The acceptance test's second look (meta_harness.CONFIRM_P), when the iteration took one."""
    if not confirm:
        return ""
    return (f'; a near miss, so both were scored on {esc(confirm.get("examples"))} more harness-split examples'
            f'{f" ({esc(rollouts)} rollouts)" if rollouts else ""}, and on both blocks together: better on '
            f'<b>{esc(confirm.get("b"))}</b>, worse on <b>{esc(confirm.get("c"))}</b>, '
            f'p = <b>{num(confirm.get("p"), 4)}</b>')


def render_iteration(it, line, members, by_name, incumbent_before, run_tests):
    """One iteration: what the run decided (the paper's choice, its paired test, the incumbent
    after), then its candidates."""
    head = f'<h3 id="{esc(_anchor(members, it))}">Iteration {esc(it)}</h3>'
    if line is None:
        decided = "<p>" + badge("in progress", "warn") + " no iterations.jsonl line yet: candidates so far.</p>"
    else:
        test = line.get("test") if isinstance(line.get("test"), dict) else None
        if test:
            verdict = badge("accepted", "ok") if line.get("accepted") else badge("not accepted", "no")
            decided = (f'<p class="accept-test">Acceptance test: <b>{esc(test.get("cand"))}</b> '
                       f'(the paper\'s choice: the archive\'s top scorer, success {num(line.get("paper_success"))}) '
                       f'against the incumbent <b>{esc(test.get("vs"))}</b> '
                       f'on the same examples: better on <b>{esc(test.get("b"))}</b>, '
                       f'worse on <b>{esc(test.get("c"))}</b>, p = <b>{num(test.get("p"), 4)}</b> '
                       f'(accept if better &gt; worse and p ≤ α = {esc(test.get("alpha"))})'
                       f'{second_look(as_dict(test.get("confirm")), line.get("confirm_rollouts"))} '
                       f'{verdict}. Incumbent after: <b>{esc(line.get("incumbent"))}</b> '
                       f'(success {num(line.get("incumbent_success"))}).</p>')
        else:
            decided = (f'<p class="accept-test">No acceptance test: the paper\'s choice (the archive\'s top '
                       f'scorer) is the incumbent <b>{esc(line.get("incumbent"))}</b> '
                       f'(success {num(line.get("incumbent_success"))}).</p>')
        cost = as_dict(line.get("cost"))
        if cost.get("proposer_calls"):
            decided += (f"<p class=dim>proposer: {esc(cost.get('proposer_calls'))} call(s), "
                        f"{esc(cost.get('proposer_prompt_tokens', 0))} prompt / "
                        f"{esc(cost.get('proposer_completion_tokens', 0))} completion tokens, "
                        f"{num(cost.get('proposer_seconds'), 1)} s</p>")
        for e in line.get("proposer_errors") or []:
            decided += f'<p class="bad">proposer error: {clip(e, 600)}</p>'
        for e in line.get("integrity") or []:  # an archive file that differed from what the search measured
            decided += f'<p class="bad">archive integrity: {clip(e, 600)}</p>'
        decided += extras(line, ITER_KNOWN)
    cards = [render_candidate(c, by_name, incumbent_before, run_tests.get(c["name"], [])) for c in members]
    return f'<section class="iteration">{head}{decided}{"".join(cards) or "<p>no candidates</p>"}</section>'


def _anchor(members, it):
    return f"it-{Path(members[0]['dir']).parent.name}-{esc(it)}" if members else f"it-{esc(it)}"


CAND_KNOWN = {"success", "mean_turns", "mean_tokens", "n", "rollouts", "missing", "status_counts", "example_ids",
              "per_example", "cand", "iteration", "proposer", "parent", "axis", "note", "cost", "dropped_after"}


def render_candidate(c, by_name, incumbent, run_tests):
    meta, s = c["meta"], c["scores"]
    marks = ""
    for it, _, accepted in run_tests:
        if accepted:
            marks += " " + badge(f"accepted in iteration {it}: the new incumbent", "ok")
    if c["name"] == incumbent:
        marks += " " + badge("incumbent", "info")
    if s and s.get("dropped_after"):  # raced and dropped: its score is over the first examples only
        marks += " " + badge(f"dropped early, after {s['dropped_after']} examples", "warn")
    if meta.get("kind") == "merge":
        marks += " " + badge("merge", "info")
    head = (f'<h4>{esc(c["name"])} <span class=dim>· proposer {esc(meta.get("proposer", "?"))}'
            f'{" · axis " + esc(meta.get("axis")) if meta.get("axis") else ""}'
            f'{" · parent " + esc(meta.get("parent")) if meta.get("parent") else ""}</span>{marks}</h4>')
    rows = [("note", clip(meta.get("note", ""), 1000))]
    if hypothesis(c["source"] or ""):  # the first line of its docstring: what its author expected
        rows.append(("hypothesis", clip(hypothesis(c["source"] or ""), 300)))
    if meta.get("kind"):  # the primitives proposer's provenance: how the candidate was made
        rows.append(("made by", render_provenance(meta)))
    if c["invalid"] is not None:
        rows.append(("validation", badge("invalid", "no") + " " + clip(c["invalid"].strip(), 1500)))
    elif s is None:
        rows.append(("validation", badge("pending", "warn") + " not evaluated yet"))
    else:
        rows.append(("validation", badge("valid", "ok") + " parses, standard library only, ran one task"))
        statuses = ", ".join(f"{esc(k)} {esc(v)}" for k, v in as_dict(s.get("status_counts")).items())
        rows.append(("search-set score", f"success <b>{num(s.get('success'))}</b> on {esc(s.get('n', '?'))} examples "
                     f"({esc(s.get('rollouts', '?'))} rollouts: {statuses}); mean turns {num(s.get('mean_turns'), 2)}, "
                     f"mean tokens {num(s.get('mean_tokens'), 0)}"))
        rows.append(("paired test vs incumbent", render_paired(c, by_name.get(incumbent), run_tests)))
    body = kv_table(rows) + extras(s, CAND_KNOWN) + extras(meta, {"iteration", "proposer", "parent", "axis", "note",
                                                                  "proposal_cost", "kind", "axes", "parents"})
    body += render_change(c, by_name)
    if c["reply"]:
        body += f"<details><summary>the proposer's raw reply</summary><pre>{clip(c['reply'], 6000)}</pre></details>"
    if s is not None:
        body += render_traces(c)
    return f'<div class="cand" id="{esc(Path(c["dir"]).parent.name)}-{esc(c["name"])}">{head}{body}</div>'


PROVENANCE_KINDS = {"swap": "one alternative swapped in", "merge": "what other lineages changed where it held or helped, "
                    "on the parent", "combine": "axes that helped in other candidates, combined",
                    "retry": "a near miss of the best, one swap further", "pair": "two alternatives swapped in at once"}


def render_provenance(meta):
    """kind, axes and parents of a primitives candidate: 'combine: format_passages from cand_004 + ...'."""
    axes, parents = meta.get("axes") or [], [str(p) for p in meta.get("parents") or []]
    donors = parents[1:] if meta.get("kind") == "combine" and len(parents) == len(axes) + 1 else []
    parts = [f"{esc(a)} from {esc(d)}" for a, d in zip(axes, donors)] if donors else [esc(a) for a in axes]
    base = f" on {esc(parents[0])}" if parents else ""
    if meta.get("kind") == "merge" and parents[1:]:
        base += f" from {', '.join(esc(p) for p in parents[1:])}"
    why = PROVENANCE_KINDS.get(meta.get("kind"), "")
    return f'<b>{esc(meta.get("kind"))}</b>: {" + ".join(parts)}{base}' + (f' <span class=dim>({why})</span>' if why else "")


def render_paired(c, inc, run_tests):
    """The run's own tests of this candidate when there are any; otherwise the same sign test
    computed here against the incumbent of its iteration (the run tests only the paper's choice)."""
    if run_tests:
        return "<br>".join(
            f'<span class="paired">vs {esc(t.get("vs"))}: better on <b>{esc(t.get("b"))}</b>, worse on '
            f'<b>{esc(t.get("c"))}</b>, p = <b>{num(t.get("p"), 4)}</b> '
            f'{badge("accepted", "ok") if accepted else badge("not accepted", "no")} '
            f'<span class=dim>(the run\'s test in iteration {esc(it)}, α = {esc(t.get("alpha"))})</span></span>'
            for it, t, accepted in run_tests)
    if inc is None or inc["name"] == c["name"]:
        return '<span class="paired">this is the incumbent</span>'
    a, b = (c["scores"] or {}), (inc["scores"] or {})
    if a.get("example_ids") != b.get("example_ids") or not a.get("per_example"):
        return f'<span class="paired">not comparable with {esc(inc["name"])} (other examples)</span>'
    better, worse, p = sign_test(a["per_example"], b.get("per_example") or [])
    return (f'<span class="paired">vs {esc(inc["name"])}: better on <b>{better}</b>, worse on <b>{worse}</b>, '
            f'p = <b>{p:.4f}</b> <span class=dim>(computed here: the run tests only the paper\'s choice, '
            f'the archive\'s top scorer of an iteration)</span></span>')


def render_change(c, by_name):
    parent = by_name.get(c["meta"].get("parent")) if c["meta"].get("parent") else None
    src = c["source"] or ""
    if parent is None:
        what = ("the incoming harness of this phase" if c["num"] == 0 else
                f"parent {esc(c['meta'].get('parent'))} is not in this archive" if c["meta"].get("parent")
                else "no parent recorded")
        return (f"<details><summary>source ({what}, {len(src.splitlines())} lines)</summary>"
                f"{render_source(src)}</details>")
    return (f"<p class=dim>change against its parent {esc(parent['name'])}:</p>" +
            render_diff(parent["source"] or "", src))


def render_diff(old, new, context=3, max_lines=400):
    """A unified diff as an HTML table: removed lines red, added green, the changed characters
    of a replaced line marked darker."""
    a, b = old.splitlines(), new.splitlines()
    groups = list(difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context))
    if not groups:
        return '<p class="diff-same">identical to its parent</p>'
    rows, added, removed = [], 0, 0

    def row(kind, ln_a, ln_b, text):
        sign = {"add": "+", "del": "−", "ctx": " "}[kind]
        rows.append(f'<tr class="{kind}"><td class=ln>{ln_a}</td><td class=ln>{ln_b}</td>'
                    f'<td class=sign>{sign}</td><td class=code>{text}</td></tr>')
    for g in groups:
        rows.append(f'<tr class="hunk"><td colspan="4">@@ −{g[0][1] + 1} +{g[0][3] + 1} @@</td></tr>')
        for tag, i1, i2, j1, j2 in g:
            if tag == "equal":
                for k in range(i2 - i1):
                    row("ctx", i1 + k + 1, j1 + k + 1, clip(a[i1 + k], 300))
                continue
            old_marked, new_marked = [clip(x, 300) for x in a[i1:i2]], [clip(x, 300) for x in b[j1:j2]]
            if tag == "replace":  # mark the changed characters of lines replaced one for one
                for k in range(min(i2 - i1, j2 - j1)):
                    old_marked[k], new_marked[k] = _intraline(a[i1 + k], b[j1 + k])
            for k, text in enumerate(old_marked):
                row("del", i1 + k + 1, "", text)
            for k, text in enumerate(new_marked):
                row("add", "", j1 + k + 1, text)
            removed, added = removed + i2 - i1, added + j2 - j1
    shown = rows[:max_lines]
    if len(rows) > max_lines:
        shown.append(f'<tr><td colspan="4"><span class="cut">[… {len(rows) - max_lines} more diff lines not shown]'
                     f'</span></td></tr>')
    return (f'<div class="diff"><p class=dim>+{added} −{removed} lines</p><table class="diff-table">'
            + "".join(shown) + "</table></div>")


def _intraline(x, y, limit=300):
    """Two replaced lines with their changed words marked (whole lines when little is shared)."""
    if len(x) > limit or len(y) > limit:
        return clip(x, limit), clip(y, limit)
    a, b = re.findall(r"\w+|\s+|[^\w\s]", x), re.findall(r"\w+|\s+|[^\w\s]", y)
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    if sm.ratio() < 0.4:
        return esc(x), esc(y)
    out_x, out_y = [], []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        old, new = esc("".join(a[i1:i2])), esc("".join(b[j1:j2]))
        out_x.append(old if tag == "equal" or not old else f"<mark>{old}</mark>")
        out_y.append(new if tag == "equal" or not new else f"<mark>{new}</mark>")
    return "".join(out_x), "".join(out_y)


def render_source(src, limit=200_000):
    lines = (src or "")[:limit].splitlines()
    body = "".join(f'<tr><td class=ln>{i}</td><td class=code>{esc(line)}</td></tr>' for i, line in enumerate(lines, 1))
    cut = (f'<p><span class="cut">[… {len(src) - limit:,} more characters not shown]</span></p>'
           if len(src or "") > limit else "")
    return f'<table class="source">{body}</table>{cut}'


def pick_traces(records):
    """Two failed rollouts (the first of each distinct status first, so a crash shows beside a
    wrong answer) and one successful one, in file order."""
    failed = [r for r in records if not (isinstance(r.get("score"), (int, float)) and r["score"] > PASS)]
    passed = [r for r in records if r not in failed]
    seen, first_of_status = set(), []
    for r in failed:
        if r.get("status") not in seen:
            seen.add(r.get("status"))
            first_of_status.append(r)
    chosen = (first_of_status + [r for r in failed if r not in first_of_status])[:2]
    return chosen, passed[:1]


def render_traces(c):
    records = read_traces(c)
    if records is None:
        return '<p class="dim no-traces">traces not kept for this candidate (no traces.jsonl)</p>'
    failed, passed = pick_traces(records)
    out = [render_trace(r, "failed") for r in failed] + [render_trace(r, "successful") for r in passed]
    note = ("" if passed else '<p class=dim>no successful rollout in this evaluation.</p>') + \
           ("" if failed else '<p class=dim>no failed rollout in this evaluation.</p>')
    return f'<div class="traces"><p class=dim>{len(records)} rollouts; examples of them:</p>{"".join(out)}{note}</div>'


TRACE_KNOWN = {"rid", "answer", "status", "error", "calls", "tool_calls", "stdout", "wall_s", "example_id", "sample",
               "score", "turns", "prompt_tokens", "completion_tokens", "tokens"}


def render_trace(r, label):
    """One rollout, collapsed: its llm() calls (messages and completion), tool calls, answer, score."""
    calls = r.get("calls") if isinstance(r.get("calls"), list) else []
    tools = r.get("tool_calls") if isinstance(r.get("tool_calls"), list) else []
    summary = (f'<summary class="{label}">{badge(label, "ok" if label == "successful" else "no")} example '
               f'{esc(r.get("example_id"))} #{esc(r.get("sample", 0))} · score {num(r.get("score"), 2)} · status '
               f'{esc(r.get("status"))} · {len(calls)} llm call(s), {len(tools)} tool call(s) · answer '
               f'<code>{clip(r.get("answer"), 120)}</code></summary>')
    parts, prev, shown_at = [], None, 0
    for i, call in enumerate(calls, 1):
        call = as_dict(call)
        msgs = call.get("messages")
        msgs = msgs if isinstance(msgs, list) else [{"role": "prompt", "content": msgs}]
        first, last = (msgs, []) if len(msgs) <= 8 else (msgs[:2], msgs[-6:])  # a long chat: its start and end
        skipped = f'<p class=dim>({len(msgs) - 8} messages in between not shown)</p>' if last else ""
        shown = "".join(map(_message, first)) + skipped + "".join(map(_message, last))
        if msgs == prev:  # another reply to the same prompt (llm(..., n=k), or a plain retry)
            shown = f'<p class=dim>(the messages of llm call {shown_at} again)</p>'
        else:
            prev, shown_at = msgs, i
        parts.append(f'<div class="call"><p><b>llm call {i}</b> <span class=dim>finish: {esc(call.get("finish", "?"))}'
                     f'</span></p>{shown}<div class="msg completion"><span class="role">completion</span>'
                     f'<pre>{clip(call.get("text"), 2000)}</pre></div></div>')
    for t in tools:
        t = as_dict(t)
        args = ", ".join([json.dumps(x, default=str) for x in t.get("args") or []] +
                         [f"{k}={json.dumps(v, default=str)}" for k, v in as_dict(t.get("kwargs")).items()])
        result = t.get("result") if t.get("error") is None else f"error: {t.get('error')}"
        parts.append(f'<div class="tool"><p><b>tool</b> <code>{esc(t.get("name"))}({clip(args, 400)})</code></p>'
                     f'<pre>{clip(result, 1500)}</pre></div>')
    tail = [("answer", f"<code>{clip(r.get('answer'), 1000)}</code>"), ("score", num(r.get("score"), 3)),
            ("status", esc(r.get("status")))]
    if r.get("error"):
        tail.append(("error", f"<pre>{clip(r.get('error'), 1500)}</pre>"))
    if r.get("stdout"):
        tail.append(("stdout", f"<pre>{clip(r.get('stdout'), 1500)}</pre>"))
    tail.append(("tokens", f"{esc(r.get('prompt_tokens', '–'))} prompt, "
                           f"{esc(r.get('completion_tokens', '–'))} completion"))
    return (f'<details class="trace">{summary}<div class="trace-body">{"".join(parts)}{kv_table(tail)}'
            f'{extras(r, TRACE_KNOWN)}</div></details>')


def _message(m):
    m = as_dict(m) or {"role": "?", "content": m}
    return (f'<div class="msg"><span class="role">{esc(m.get("role", "?"))}</span>'
            f'<pre>{clip(m.get("content"), 2000)}</pre></div>')


def render_final(run):
    src, where = final_harness(run)
    body = render_source(src) if src is not None else "<p>No harness found.</p>"
    ended = "ended with" if run["summary"] is not None else "holds now (still running or stopped)"
    return f'<h2 id="final">The harness the run {ended}</h2><p class=dim>from {esc(where)}</p>{body}'


CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1150px;
padding:0 16px;color:#222}
h1{margin-bottom:0}h2{border-bottom:1px solid #ccc;margin-top:2em}h4{margin:.2em 0}
table{border-collapse:collapse;margin:.5em 0;display:block;max-width:100%;overflow-x:auto}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
table.num td{text-align:right}table.kv th{background:#f6f6f6;font-weight:600;white-space:nowrap}
.dim{color:#666}.cut{color:#a40;font-style:italic;background:#fff3e0;padding:0 3px}
.badge{display:inline-block;border-radius:3px;padding:0 5px;font-size:12px;font-weight:600;color:#fff;background:#777}
.badge.ok{background:#2e7d32}.badge.no{background:#c62828}.badge.warn{background:#ef6c00}.badge.info{background:#1565c0}
.iteration{border-left:3px solid #f0b070;padding-left:12px;margin:1em 0}
.cand{border:1px solid #ddd;border-radius:4px;padding:8px;margin:.8em 0;background:#fcfcfc}
.accept-test{background:#fff8e1;padding:4px 8px}.bad{color:#c62828}.extra{font-size:12px;color:#555}
.diff-table,.source{font:12px/1.35 ui-monospace,Menlo,Consolas,monospace;width:100%}
.diff-table td,.source td{border:none;padding:0 6px;white-space:pre-wrap;word-break:break-all}
td.ln{color:#999;text-align:right;width:3em;user-select:none}td.sign{width:1em}
tr.add{background:#e6ffec}tr.del{background:#ffebe9}tr.add mark{background:#abf2bc}tr.del mark{background:#ffc0c0}
tr.hunk td{background:#eef3ff;color:#557}.source{background:#fafafa;border:1px solid #eee}
pre{white-space:pre-wrap;word-break:break-word;background:#f7f7f7;padding:4px 6px;margin:2px 0;font-size:12px}
details{margin:.3em 0}summary{cursor:pointer}.trace-body{border-left:2px solid #ccc;padding-left:8px}
.role{font-size:11px;font-weight:700;color:#555;text-transform:uppercase}.completion pre{background:#eef7ee}
nav{margin:1em 0}svg text.tick{font-size:11px;fill:#444}svg text.band{font-size:11px;fill:#777;text-anchor:middle}
svg line.grid{stroke:#eee}table.index td{white-space:nowrap}
"""


def page(title, body):
    # default-src 'none': the page may load nothing (no network, no file), only its inline CSS.
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'; '
            f'img-src data:"><meta name="viewport" content="width=device-width,initial-scale=1">'
            f'<title>{esc(title)}</title><style>{CSS}</style></head><body>{body}'
            f'<p class=dim>written by report.py from the run\'s files</p></body></html>\n')


def render_run(run):
    sections = timeline(run["metrics"])
    phases = {p["cycle"]: p for p in run["phases"]}
    logged = {s["cycle"] for s in sections if s["kind"] == "B"}

    def part(render, *args):  # a record this page cannot make sense of costs its section, not the page
        try:
            return render(*args)
        except Exception as e:
            return (f'<p class="bad">report.py could not render this part ({esc(render.__name__)}: '
                    f'{esc(type(e).__name__)}: {clip(e, 300)}); the run\'s files are unchanged.</p>')
    parts = [part(render_header, run, sections), part(render_summary, run), part(render_curve, run, sections)]
    if sections and (sections[0]["evals"] or sections[0].get("other")):
        parts.append("<h2>Initial evaluation</h2>" + part(render_other, sections[0]) +
                     part(render_evals, sections[0]["evals"]))
    for s in sections[1:]:
        parts.append(part(render_phase_a, s) if s["kind"] == "A" else
                     part(render_phase_b, s, phases.get(s["cycle"]), run))
    for p in run["phases"]:  # a harness phase still running: in the archive, not yet in metrics.jsonl
        if p["cycle"] not in logged:
            parts.append(part(render_phase_b, None, p, run))
    parts.append(part(render_final, run))
    cfg = run["config"]
    return page(f"WHALE {cfg.get('method', '?')} {cfg.get('domain', '?')} s{cfg.get('seed', '?')}", "".join(parts))


def write_page(path, text):
    """Write text to path atomically, through a new file (never through a link a received folder
    holds under the page's name or the temporary one's)."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # (gone after a successful replace)
    return path


def write_report(run_dir, run=None):
    """Write run_dir/report.html (atomically) and return its path."""
    run_dir = Path(run_dir)
    return write_page(run_dir / "report.html", render_run(run or read_run(run_dir)))


def write_index(grid_dir, force=False):
    """grid_dir/index.html: one row per run under grid_dir, linking its report; writes the
    reports that are missing or older than their run's files (all of them with force)."""
    grid_dir = Path(grid_dir)
    rows = []
    for d in find_runs(grid_dir):
        report = d / "report.html"
        try:
            run = read_run(d)
        except BadRun as e:  # one bad run is a row saying so, never the end of the index
            print(f"report: {d}: skipped: {e}", file=sys.stderr)
            rows.append(f'<tr><td>{esc(d.relative_to(grid_dir).as_posix())}</td>'
                        f'<td colspan="12">{badge("skipped", "no")} {clip(str(e), 300)}</td></tr>')
            continue
        if force or not report.exists() or report.stat().st_mtime < run_files_mtime(d):
            try:
                write_report(d, run)
            except OSError as e:  # one unwritable run (read-only copy, full disk) does not stop the index
                print(f"report: {d}: cannot write report.html ({e.strerror or e})", file=sys.stderr)
        cfg, s = run["config"], as_dict(run["summary"])
        rel = "./" + urllib.parse.quote(report.relative_to(grid_dir).as_posix())  # never a scheme (javascript:)
        status = badge("finished", "ok") if run["summary"] is not None else badge("in progress or stopped", "warn")
        n_phases = len(run["phases"])
        rows.append(f'<tr><td><a href="{esc(rel)}">{esc(d.relative_to(grid_dir).as_posix() or d.name)}</a></td>'
                    f"<td>{esc(cfg.get('domain', '?'))}</td><td>{esc(cfg.get('method', '?'))}</td>"
                    f"<td>{esc(cfg.get('schedule', '?'))}</td>"
                    f"<td>{esc(cfg.get('seed', '?'))}</td><td>{status}</td>"
                    f"<td>{esc(s.get('rollouts', '–'))} / {esc(cfg.get('budget', '?'))}</td>"
                    f"<td>{mean_se(s.get('test_mean8_initial'), s.get('test_mean8_initial_se'))}</td>"
                    f"<td>{mean_se(s.get('test_mean8_final'), s.get('test_mean8_final_se'))}</td>"
                    f"<td>{mean_se(s.get('test_gain'), s.get('test_gain_se'), signed=True)}</td>"
                    f"<td>{mean_se(s.get('test_mean8_best_val'), s.get('test_mean8_best_val_se'))}</td>"
                    f"<td>{esc(s.get('steps', '–'))}</td><td>{n_phases}</td></tr>")
    body = (f"<h1>WHALE runs under {esc(grid_dir)}</h1><p>{len(rows)} runs. Test mean@k ± SE (each run's page "
            "gives the 95% intervals); the gain is final − initial on the same questions, with its paired SE.</p>"
            "<table class=index><tr><th>run</th><th>domain</th><th>method</th><th>schedule</th><th>seed</th>"
            "<th>status</th><th>rollouts / budget</th>"
            "<th>test initial</th><th>test final</th><th>gain</th><th>best on validation</th><th>RSFT steps</th>"
            f"<th>harness phases</th></tr>{''.join(rows)}</table>")
    return write_page(grid_dir / "index.html", page(f"WHALE runs: {grid_dir}", body)), len(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description="Write report.html for a WHALE run, or index.html for a folder of runs.")
    p.add_argument("path", help="a run directory, or a folder holding run directories")
    p.add_argument("--force", action="store_true", help="grid: rewrite every run's report, not only missing/stale ones")
    a = p.parse_args(argv)
    path = Path(a.path)
    if not path.is_dir():
        print(f"report: error: {path} is not a directory", file=sys.stderr)
        return 2
    if is_run_dir(path):
        try:
            print(write_report(path))
        except BadRun as e:
            print(f"report: error: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"report: error: cannot write {path / 'report.html'} ({e.strerror or e})", file=sys.stderr)
            return 1
        return 0
    if not find_runs(path):
        print(f"report: error: no run directory (with metrics.jsonl, config.json or run.zip) under {path}", file=sys.stderr)
        return 2
    index, n = write_index(path, force=a.force)
    print(f"{index} ({n} runs)")
    return 0
