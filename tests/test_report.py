"""
The run report (tools/report.py), in a headless browser too.
"""
import html
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import types

import pytest

import switch
import whale
from harness_search import harness_source as hsrc
from rundir import run_setup
from rundir import report
from rundir import run_reader
from tools import results
from tests.helpers import ROOT, copy_run


@pytest.mark.slow
def test_report_of_a_tiny_run_shows_every_phase_candidate_trace_and_the_final_harness(tiny_reference):
    page = (tiny_reference / "report.html").read_text()  # written by evaluation.finish()
    run = run_reader.read_run(tiny_reference)
    s = run["summary"]
    assert "finished" in page and f"{s['test_mean8_initial']:.3f} ± {s['test_mean8_initial_se']:.3f}" in page
    assert "<svg" in page and page.count('class="band"') == len(report.phase_spans(report.timeline(run["metrics"]),
                                                                                   run["phases"]))
    steps = [r for r in run["metrics"] if r.get("event") == "rollout_step"]
    cycles = sorted({r["cycle"] for r in steps})
    assert all(f'id="phase-A{c}"' in page for c in cycles) and 'id="phase-B0"' in page
    for r in steps:  # every phase-A step's row: step number, cumulative rollouts, its loss
        assert f"<td>{r['step']}</td><td>{r['rollouts']}</td>" in page and report.num(r.get("loss"), 4) in page
    cands = run["phases"][0]["candidates"]
    assert len(cands) >= 2 and all(c["meta"].get("parent") for c in cands[1:])  # proposals: cards with a diff
    for c in cands:
        assert f'id="phase00-{c["name"]}"' in page
        records = run_reader.read_traces(c)
        failed = [r for r in records if r["score"] <= 0.5]
        # two failed and one successful trace (or as many as there are), each collapsed
        card = page.split(f'id="phase00-{c["name"]}"')[1].split('<div class="cand"')[0]
        assert card.count('<details class="trace">') == min(2, len(failed)) + min(1, len(records) - len(failed))
        assert "<details open" not in card
        if hsrc.hypothesis(c["source"]):  # its docstring's first line, as the candidate's hypothesis
            assert f"<th>hypothesis</th><td>{html.escape(hsrc.hypothesis(c['source']))}" in card
        if c["meta"].get("parent"):  # a diff against the parent, with its added and removed lines
            assert 'class="diff-table"' in card and ('<tr class="add">' in card or '<tr class="del">' in card)
            assert "better on" in card and "worse on" in card and "p = " in card
    fit = next(r for r in run["metrics"] if r.get("event") == "memory_fit")  # a CPU run: auto's 4 GB
    assert f"training forwards of at most {fit['max_forward_tokens']}" in page
    final = sorted((tiny_reference / "harnesses").glob("*.py"))[-1].read_text()
    tail = page.split('id="final"')[1]
    assert all(f"<td class=code>{html.escape(line)}</td>" in tail for line in final.splitlines())
    # self-contained: nothing to load, no script, and a policy that would block both
    assert "default-src 'none'" in page and "<script" not in page.lower()
    assert not re.search(r'(src|href)="(https?:|//)', page)


@pytest.mark.slow
def test_console_summary_report_and_curve_count_a_tiny_run_the_same(tiny_reference):
    """One number everywhere: phase B's candidates (those proposed: cand_000 is the incoming harness),
    iterations and rollouts are the same in the console's closing table, summary.json and report.html;
    curve.png and the report shade the phases in the same colours; the full test split, scored only at
    the start and the end, is never drawn as a line across the phases between."""
    from matplotlib import image

    from rundir.phases import PHASE_FILL, SPLIT_COLOUR, plural, table
    s = json.loads((tiny_reference / "summary.json").read_text())
    console = (tiny_reference.parent / "stdout.txt").read_text()
    page = (tiny_reference / "report.html").read_text()
    b = next(p for p in s["phases"] if p["phase"] == "B")
    assert b["candidates"] == s["harness_candidates"] > 0
    assert b["rollouts"] == b["rollouts_end"] - b["rollouts_start"] > 0
    line = next(x for x in table(tiny_reference, 1) if x.split()[:1] == ["B0"])  # the closing table's B0 row
    said = f"{plural(b['iterations'], 'iteration')}, {plural(b['candidates'], 'candidate')}"
    assert line in console and line.split()[4] == str(b["rollouts"]) and said in line, line
    assert f"<td>{b['rollouts']}</td>" in page and said in page
    pixels = (image.imread(tiny_reference / "curve.png")[..., :3] * 255).round().astype(int).reshape(-1, 3).tolist()
    seen = {tuple(x) for x in pixels}
    for fill in PHASE_FILL.values():
        assert f'fill="{fill}"' in page and tuple(int(fill[i:i + 2], 16) for i in (1, 3, 5)) in seen, fill
    assert f'<polyline points' in page and f'stroke="{SPLIT_COLOUR["test"]}" stroke-width="1.5"' not in page
    # the run's bar counts every rollout it waits for, the initial test's too (or its ETA is off from the
    # start), and ends full: the budget spent and every full-test evaluation (initial, final, the 2 x 2's)
    bars = re.findall(r"whale searchqa: +\d+%\|[^|]*\| (\d+)/(\d+) \[", (tiny_reference.parent / "stderr.txt").read_text())
    lines = [json.loads(x) for x in (tiny_reference / "metrics.jsonl").read_text().splitlines()]
    tests = sum(x["event"] == "two_by_two" or x["event"] == "eval" and x["split"] == "test" for x in lines)
    per_test = s["test_examples"] * json.loads((tiny_reference / "config.json").read_text())["test_n"]
    assert tests >= 2 and bars[-1] == (str(s["rollouts"] + tests * per_test),) * 2, bars[-3:]


def test_report_trace_shows_a_prompt_once_for_the_replies_to_it():
    """A voting rollout (llm(..., n=3), then a second turn): the prompt is shown once, at its
    first call, every reply is shown, and the second turn's new prompt is shown in full."""
    ask = [{"role": "user", "content": "Who built the <roof>?"}]
    again = ask + [{"role": "assistant", "content": "no idea"}, {"role": "user", "content": "Look again."}]
    calls = [{"messages": ask, "text": f"reply {k}", "finish": "stop"} for k in range(3)]
    calls.append({"messages": again, "text": "<answer>Ivo</answer>", "finish": "stop"})
    page = report.render_trace({"example_id": 7, "calls": calls, "answer": "Ivo", "score": 1.0, "status": "ok"},
                               "successful")
    assert page.count("Who built the &lt;roof&gt;?") == 2  # call 1 and, inside its history, call 4
    assert page.count("(the messages of llm call 1 again)") == 2 and "Look again." in page
    assert all(f"reply {k}" in page for k in range(3)) and "&lt;answer&gt;Ivo&lt;/answer&gt;" in page


@pytest.mark.slow
def test_report_escapes_cuts_and_renders_runs_in_progress_and_without_traces(tiny_reference, tmp_path):
    run = copy_run(tiny_reference, tmp_path / "run")
    (run / "summary.json").unlink()  # still running
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"event": "phase_stop", "cycle": 1, "why": "budget"}\n')  # an event this page does not know
        f.write('{"event": "rollout_st')  # a line cut short by a kill
    arch = run / "archive" / "phase00"
    meta = json.loads((arch / "cand_001" / "meta.json").read_text())
    meta["note"] = "<script>alert(1)</script>" + "x" * 5000
    meta["proposer_cost_usd"] = 0.25  # a field this page does not know
    (arch / "cand_001" / "meta.json").write_text(json.dumps(meta))
    (arch / "cand_002" / "traces.jsonl").unlink()
    lines = [json.loads(x) for x in (arch / "iterations.jsonl").read_text().splitlines()]
    lines[-1]["stop_reason"] = "budget"
    (arch / "iterations.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    bad = arch / "cand_099"
    bad.mkdir()
    (bad / "harness.py").write_text("def run(:\n")
    (bad / "meta.json").write_text(json.dumps({"iteration": 1, "proposer": "self", "parent": "cand_000", "note": "n"}))
    (bad / "invalid.txt").write_text("syntax error: invalid syntax (line 1)\n")
    (bad / "reply.txt").write_text("```python\ndef run(:\n```")
    running = run / "archive" / "phase01" / "cand_000"  # a harness phase that has just begun
    running.mkdir(parents=True)
    (running / "harness.py").write_text((arch / "cand_000" / "harness.py").read_text())
    (running / "meta.json").write_text(json.dumps({"iteration": 0, "proposer": "incoming"}))
    page = report.write_report(run).read_text()
    assert "in progress or stopped" in page and "--resume" in page
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "more characters not shown" in page
    # fields and events the page does not know: collapsed, named in the summary line, never loose text
    assert "more fields: " in page and "proposer_cost_usd" in page and "stop_reason" in page
    assert "1 other event: phase_stop" in page and "other fields" not in page and "<p class=\"extra\">event" not in page
    assert "1 of 3 evaluated candidates have no traces.jsonl" in page and "traces not kept for this candidate" in page
    card = page.split('id="phase00-cand_099"')[1]
    assert "invalid" in card and "syntax error: invalid syntax" in card and "raw reply" in card
    assert 'id="phase-B1"' in page and "not evaluated yet" in page.split('id="phase-B1"')[1]


@pytest.mark.slow
def test_report_cli_writes_an_index_of_a_grid_and_refuses_a_bad_path(tiny_reference, tmp_path):
    grid = tmp_path / "grid"
    copy_run(tiny_reference, grid / "runs" / "tiny")
    copy_run(ROOT / "results" / "runs" / "cpu" / "searchqa-whale-s0", grid / "runs" / "committed")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(grid)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "2 runs" in r.stdout, r.stderr
    index = (grid / "index.html").read_text()
    for name in ("tiny", "committed"):
        assert f'href="./runs/{name}/report.html"' in index and (grid / "runs" / name / "report.html").exists()
    for bad in (tmp_path / "nosuch", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(bad)], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "report: error" in r.stderr, r.stderr
    # a run whose report cannot be written: one line; in a grid, the other runs and the index still are
    (grid / "runs" / "tiny" / "report.html").unlink()
    (grid / "runs" / "tiny" / "report.html").mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(grid / "runs" / "tiny")], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "cannot write" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(grid), "--force"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "2 runs" in r.stdout and r.stderr.count("cannot write") == 1, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("preset,n_cells", [("cpu", 18), ("cpu-long", 4), ("cpu-long-search", 1), ("cpu-long-look", 1),
                                            ("cpu-long-vote", 1), ("cpu-long-typed", 1),
                                            ("cpu-claim", 6)])
def test_every_run_all_preset_is_a_valid_whale_command(tmp_path, preset, n_cells):
    """run_all.sh's cells, as whale.py would get them, pass run_setup.check_args (a flag misspelt
    in a preset would otherwise surface only when its grid starts). run_all.sh runs from an
    empty copy of the repository's top level, with `python` a stand-in that records its argv:
    every cell is then new. (Not the paper preset: its checks need vLLM and the model hub.)"""
    (tmp_path / "bin").mkdir()
    calls = tmp_path / "calls"
    (tmp_path / "bin" / "python").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" "--end--" >> {calls}\n')
    (tmp_path / "bin" / "python").chmod(0o755)
    shutil.copy(ROOT / "run_all.sh", tmp_path / "run_all.sh")
    r = subprocess.run(["bash", "run_all.sh", preset], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SEEDS": "0"})
    assert r.returncode == 0, r.stderr
    argvs = [a.split("\n") for a in calls.read_text().split("--end--\n") if a]
    cells = [a[1:-1] for a in argvs if a[0] == "whale.py"]
    # SEEDS=0: one cell per domain x method (cpu: 3 x 6; cpu-long: searchqa x 4; the menu grids: harness-only;
    # cpu-claim: searchqa and math x 3)
    assert len(cells) == n_cells and all("--out" in c for c in cells), [c[c.index("--out") + 1] for c in cells]
    for argv in cells:
        run_setup.check_args(run_setup.parse_args(whale.Args, argv), whale.METHODS, switch.check)
    # the grid's summary goes into a README that holds its block (results.py refuses one that does not)
    summary = [a[1:-1] for a in argvs if a[0] == "tools/results.py" and "--pack" not in a]
    assert len(summary) == 1 and "--readme" in summary[0], summary
    readme = (ROOT / summary[0][summary[0].index("--readme") + 1]).read_text()
    assert all(readme.count(m) == 1 for m in results.markers(f"results/runs/{preset}"))


COMMITTED_GRIDS = sorted([*(ROOT / "results" / "runs").iterdir(), ROOT / "results" / "preset" / "runs"])


@pytest.mark.parametrize("grid", COMMITTED_GRIDS, ids=lambda g: str(g.relative_to(ROOT / "results")))
def test_every_committed_run_has_its_report_and_the_index_links_them(grid):
    runs = run_reader.find_runs(grid)
    assert runs and runs == sorted(d for d in grid.iterdir() if d.is_dir())  # every directory there is a run
    index = (grid / "index.html").read_text()
    assert sorted(re.findall(r'href="([^"]+/report\.html)"', index)) == [f"./{d.name}/report.html" for d in runs]
    for d in runs:
        assert (d / "report.html").exists(), f"{d} has no report.html: run python tools/report.py {grid.relative_to(ROOT)}"
        page = (d / "report.html").read_text()
        cfg = run_reader.read_run(d)["config"]  # from config.json, or from a packed run's run.zip
        assert f"{cfg['method']} on {cfg['domain']}, seed {cfg['seed']}" in page
        if grid.parent == ROOT / "results" / "runs":  # a finished grid's run is two files (results.py --pack)
            assert sorted(p.name for p in d.iterdir()) == ["report.html", "run.zip"], d
        assert f'href="./{d.name}/report.html"' in index
        if (d / "archive").is_dir():  # committed without traces.jsonl (git ignores them): the page says so
            assert "traces not kept" in page and "traces not kept" in report.render_run(run_reader.read_run(d))


# Chromium over the DevTools protocol on a pipe (--remote-debugging-pipe): JSON messages ended by
# a NUL byte, commands on the browser's fd 3, replies and events on its fd 4. No websocket, no
# third-party package: the test needs only the browser.
CHROMIUM = os.environ.get("WHALE_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def headless_chromium(tmp_path, timeout=60):
    cmd_r, cmd_w = os.pipe()
    out_r, out_w = os.pipe()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-extensions", "--window-size=1280,1024",
             f"--user-data-dir={tmp_path / 'chromium-profile'}", "--remote-debugging-pipe", "about:blank"]
    # Chromium reads fd 3 and writes fd 4: a Python shim moves the pipe ends there (via fds >= 10,
    # so that neither overwrites the other) and execs the browser.
    shim = ("import fcntl, os, sys; r, w = (fcntl.fcntl(int(x), fcntl.F_DUPFD, 10) for x in sys.argv[1:3]); "
            "os.dup2(r, 3); os.dup2(w, 4); os.execv(sys.argv[3], sys.argv[3:])")
    proc = subprocess.Popen([sys.executable, "-c", shim, str(cmd_r), str(out_w), CHROMIUM, *flags],
                            pass_fds=(cmd_r, out_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(cmd_r)
    os.close(out_w)
    events, buf, ids = [], [b""], [0]

    def receive(deadline):
        while b"\0" not in buf[0]:
            if not select.select([out_r], [], [], max(0.0, deadline - time.time()))[0]:
                raise TimeoutError("Chromium did not answer")
            chunk = os.read(out_r, 1 << 16)
            if not chunk:
                raise EOFError("Chromium closed the pipe")
            buf[0] += chunk
        msg, buf[0] = buf[0].split(b"\0", 1)
        return json.loads(msg)

    def send(method, session=None, **params):
        ids[0] += 1
        msg = {"id": ids[0], "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            reply = receive(deadline)
            if reply.get("id") == ids[0]:
                assert "error" not in reply, (method, reply["error"])
                return reply.get("result", {})
            events.append(reply)

    def wait(method):
        deadline = time.time() + timeout
        while not any(e.get("method") == method for e in events):
            events.append(receive(deadline))

    def close():
        try:
            send("Browser.close")
        except (OSError, EOFError, TimeoutError, AssertionError):
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(cmd_w)
        os.close(out_r)
    return types.SimpleNamespace(send=send, wait=wait, events=events, close=close)


RENDERED_CHECKS = """(() => {
  const shown = el => !!el && el.checkVisibility() && el.getBoundingClientRect().height > 0;
  const diff = [...document.querySelectorAll('.diff-table tr.add, .diff-table tr.del')].filter(shown);
  const paired = [...document.querySelectorAll('.paired')].filter(
      e => shown(e) && /better on \\d+, worse on \\d+, p = [0-9.]+/.test(e.innerText));
  const trace = document.querySelector('details.trace');
  trace.scrollIntoView();
  const r = trace.querySelector('summary').getBoundingClientRect();
  return JSON.stringify({diff: diff.length, diff_text: diff.map(e => e.innerText).join('\\n').slice(0, 300),
    paired: paired.length, paired_text: paired.length ? paired[0].innerText : '',
    accept: [...document.querySelectorAll('.accept-test')].filter(shown).length,
    trace_open: trace.open, trace_body_shown: shown(trace.querySelector('.trace-body')),
    click: [r.x + 20, r.y + r.height / 2]});
})()"""


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (the browser test needs one: Debian's `apt-get install "
                                             "chromium`, which .ci/run does; or set WHALE_CHROMIUM=/path/to/chrome)")
def test_report_in_headless_chromium_shows_diff_acceptance_test_and_a_trace(tiny_reference, tmp_path):
    url = (tiny_reference / "report.html").as_uri()
    b = headless_chromium(tmp_path)
    try:
        target = b.send("Target.createTarget", url="about:blank")["targetId"]
        s = b.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            b.send(f"{domain}.enable", session=s)
        b.send("Emulation.setDeviceMetricsOverride", session=s, width=1280, height=900, deviceScaleFactor=1,
               mobile=False)  # issue 70: the page fits a 1280 px window
        b.send("Page.navigate", session=s, url=url)
        b.wait("Page.loadEventFired")

        def evaluate(expr):
            res = b.send("Runtime.evaluate", session=s, expression=expr, returnByValue=True)
            assert "exceptionDetails" not in res, res
            return res["result"]["value"]
        page = json.loads(evaluate("JSON.stringify({text: document.body.innerText, wide: "
                                   "document.documentElement.scrollWidth - document.documentElement.clientWidth})"))
        assert page["wide"] <= 0, page["wide"]  # no sideways scroll: a wide table scrolls in its own box
        assert not re.search(r"event \{|other fields", page["text"])  # no raw record is printed as text
        seen = json.loads(evaluate(RENDERED_CHECKS))
        assert seen["diff"] > 0 and seen["paired"] > 0 and seen["accept"] > 0, seen
        assert not seen["trace_open"] and not seen["trace_body_shown"], seen  # collapsed by default
        x, y = seen["click"]  # a real mouse click on the first trace's summary line opens it
        for kind in ("mousePressed", "mouseReleased"):
            b.send("Input.dispatchMouseEvent", session=s, type=kind, x=x, y=y, button="left", clickCount=1)
        body = evaluate("(() => { const t = document.querySelector('details.trace'); const b = t.querySelector("
                        "'.trace-body'); return JSON.stringify({open: t.open, shown: b.checkVisibility() && "
                        "b.getBoundingClientRect().height > 0, text: b.innerText}); })()")
        body = json.loads(body)
        assert body["open"] and body["shown"], body
        assert "llm call 1" in body["text"] and "completion" in body["text"].lower() and "score" in body["text"]
        errors = [e for e in b.events if e.get("method") == "Runtime.exceptionThrown"
                  or (e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") in ("error", "assert"))
                  or (e.get("method") == "Log.entryAdded" and e["params"]["entry"].get("level") == "error")]
        assert not errors, errors
        loads = [e["params"]["request"]["url"] for e in b.events if e.get("method") == "Network.requestWillBeSent"]
        assert loads == [url], loads  # the page itself and nothing else
    finally:
        b.close()


def test_the_closing_table_says_what_each_phase_did(tmp_path):
    """rundir/phases.py reads metrics.jsonl (and the archive's summary lines) back into one row per
    phase: phase A's steps, kept rollouts and trained tokens, phase B's iterations, candidates and
    what the sign test accepted, each with validation before -> after and its span of rollouts."""
    from rundir import phases
    events = [dict(t=0.0, event="start", rollouts=0),
              dict(t=10.0, event="eval", split="val", tag="initial", cycle=0, rollouts=0, mean=0.1),
              dict(t=40.0, event="rollout_step", cycle=0, step=1, rollouts=128, step_rollouts=128, kept=12,
                   trained_tokens=300),
              dict(t=70.0, event="rollout_step", cycle=0, step=2, rollouts=256, step_rollouts=128, kept=20,
                   trained_tokens=500),
              dict(t=80.0, event="eval", split="val", tag="A0", cycle=0, rollouts=256, mean=0.2),
              dict(t=90.0, event="harness_candidate", cycle=0, rollouts=384, cand="cand_000", status="ok"),
              dict(t=95.0, event="harness_iteration", cycle=0, rollouts=384, iteration=0, accepted=False,
                   incumbent_success=0.05, test=None),
              dict(t=99.0, event="harness_candidate", cycle=0, rollouts=512, cand="cand_001", status="ok"),
              dict(t=120.0, event="harness_iteration", cycle=0, rollouts=512, iteration=1, accepted=True,
                   incumbent_success=0.09, test=dict(cand="cand_001")),
              dict(t=130.0, event="eval", split="val", tag="B0", cycle=1, rollouts=512, mean=0.25),
              dict(t=150.0, event="rollout_step", cycle=1, step=3, rollouts=640, step_rollouts=128, kept=30,
                   trained_tokens=700)]  # a run stopped in its second weight phase: no point after it
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"torn')
    (tmp_path / "archive" / "phase00").mkdir(parents=True)
    (tmp_path / "archive" / "phase00" / "summary.jsonl").write_text(json.dumps(
        dict(cand="cand_001", axis="RETRIEVAL", note="RETRIEVAL: alternative 2/5 on cand_000")) + "\n")
    a, b, a2 = phases.phases(tmp_path)
    assert (a["phase"], a["steps"], a["kept"], a["rollouts"], a["trained_tokens"]) == ("A", 2, 32, 256, 800)
    assert (a["val_before"], a["val_after"], a["rollouts_start"], a["rollouts_end"]) == (0.1, 0.2, 0, 256)
    assert (b["phase"], b["iterations"], b["candidates"], b["search_before"], b["search_after"]) == ("B", 1, 1, 0.05, 0.09)
    assert b["accepted"] == [dict(cand="cand_001", axis="RETRIEVAL", hypothesis="RETRIEVAL: alternative 2/5 on cand_000")]
    assert (b["val_before"], b["val_after"], b["rollouts_start"], b["rollouts_end"]) == (0.2, 0.25, 256, 512)
    assert (a2["cycle"], a2["val_before"], a2["val_after"], a2["rollouts_end"]) == (1, 0.25, None, 640)
    rows = phases.table(tmp_path, 2)  # (the numbers each row must carry; its wording is free)
    assert len(rows) == 4 and all(x in rows[1] for x in ("0.100", "0.200", "32", "256", "800"))
    assert all(x in rows[2] for x in ("cand_001", "RETRIEVAL", "0.050", "0.090")) and "0.250" in rows[3]


def test_the_closing_table_says_in_one_line_when_a_half_had_nothing_to_work_with(tmp_path):
    """A chess-like run at this scale: phase A kept nothing and phase B accepted nothing; each says so."""
    from rundir import phases
    events = [dict(t=0.0, event="eval", split="val", tag="initial", cycle=0, rollouts=0, mean=0.0),
              dict(t=5.0, event="rollout_step", cycle=0, step=1, rollouts=128, step_rollouts=128, kept=0,
                   trained_tokens=0),
              dict(t=6.0, event="eval", split="val", tag="A0", cycle=0, rollouts=128, mean=0.0),
              dict(t=9.0, event="harness_iteration", cycle=0, rollouts=256, iteration=0, accepted=False,
                   incumbent_success=0.0, test=None),
              dict(t=9.5, event="eval", split="val", tag="B0", cycle=1, rollouts=256, mean=0.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    notes = [x for x in phases.table(tmp_path, 2) if x.strip().startswith("note:")]
    assert len(notes) == 2 and "phase A" in notes[0] and "phase B" in notes[1]
