"""
What the project reads that someone else made (jail/received.py and its readers: tools/report.py,
tools/results.py, harness_archive's pack and unpack, tools/run_agent.py, the proposers' endpoints,
a model's chat template and remote code): paths stay inside, links are not followed, HTML is
escaped, sizes and times are capped, and a bad file is one line naming it.
"""
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile

import pytest

from harness_search import harness_archive
from jail import received
from lm import chat_format
from tests.helpers import ROOT, copy_run
from rundir import report
from rundir import run_reader

SECRET = "whale-test-secret-4711"


def a_run(tmp_path, name="run", config=None, metrics=None):
    """A small finished-looking run directory, made by hand as a received one would be."""
    d = tmp_path / name
    (d / "archive" / "phase0" / "cand_000").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"method": "weight-only", "domain": "searchqa", "seed": 0, **(config or {})}))
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (metrics or [
        {"event": "eval", "split": "test", "tag": "initial", "rollouts": 0, "mean": 0.1, "se": 0.01, "n": 2}])) + "\n")
    (d / "archive" / "phase0" / "cand_000" / "harness.py").write_text("def run(task, llm, tools):\n    return 'x'\n")
    return d


def test_a_path_a_run_names_is_resolved_inside_it_or_refused(tmp_path):
    assert received.inside(tmp_path, "harnesses/h.py") == str(tmp_path / "harnesses" / "h.py")
    for bad in ("/proc/self/environ", "/etc/shadow", "../outside.py", "a/../../b", ""):
        with pytest.raises(ValueError):
            received.inside(tmp_path, bad)


def test_the_report_never_opens_a_file_a_run_names_outside_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WHALE_RECEIVED_SECRET", SECRET)  # in /proc/self/environ of the process writing the page
    secret_file = tmp_path / "private.txt"
    secret_file.write_text(SECRET)
    for name, harness in (("environ", "/proc/self/environ"), ("private", str(secret_file)), ("up", "../private.txt")):
        d = a_run(tmp_path, name, config={"harness": harness})
        page = report.render_run(run_reader.read_run(d))
        assert SECRET not in page and "outside the run directory, so not opened" in page


def test_no_symbolic_link_in_a_run_is_followed_when_reading_or_packing(tmp_path):
    secret_file = tmp_path / "private.txt"
    secret_file.write_text(SECRET)
    d = a_run(tmp_path)
    cand = d / "archive" / "phase0" / "cand_000"
    (cand / "harness.py").unlink()
    (cand / "harness.py").symlink_to(secret_file)  # a candidate's source that is a link
    (d / "harnesses").mkdir()
    (d / "harnesses" / "h1.py").symlink_to(secret_file)
    with pytest.raises(run_reader.BadRun, match="symbolic link"):
        run_reader.read_run(d)
    (cand / "harness.py").unlink()
    (cand / "harness.py").write_text("def run(task, llm, tools):\n    return 'x'\n")
    assert SECRET not in report.render_run(run_reader.read_run(d))  # the harnesses/ link is skipped
    (d / "summary.json").write_text(json.dumps({"test_mean8_final": 0.1}))
    (d / "archive" / "phase0" / "notes.txt").symlink_to(secret_file)
    packed = harness_archive.pack_run(d)
    with zipfile.ZipFile(packed) as z:
        assert all(SECRET.encode() not in z.read(m) for m in z.namelist())
        assert "harnesses/h1.py" not in z.namelist() and "archive/phase0/notes.txt" not in z.namelist()
    assert secret_file.read_text() == SECRET  # what a link pointed to is untouched


def test_comparing_received_runs_follows_no_link_and_a_torn_line_is_a_difference(tmp_path):
    """tools/same_runs.py reads two folders of runs from anywhere: a metrics.jsonl that is a link is
    one line and exit 2 (its target never read), a torn line a difference, equal runs exit 0."""
    secret_file = tmp_path / "private.txt"
    secret_file.write_text(json.dumps({"event": SECRET}) + "\n")
    for side in ("before", "after"):
        (a_run(tmp_path / side) / "summary.json").write_text(json.dumps({"test_mean8_final": 0.1, "seconds": 9}))

    def same_runs():
        return subprocess.run([sys.executable, "tools/same_runs.py", str(tmp_path / "before"), str(tmp_path / "after")],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
    r = same_runs()
    assert r.returncode == 0 and "identical" in r.stdout, r.stdout + r.stderr
    with open(tmp_path / "after" / "run" / "metrics.jsonl", "a") as f:
        f.write('{"event": "rollout_st')  # a line a kill cut short
    r = same_runs()
    assert r.returncode == 1 and "not JSON" in r.stdout, r.stdout + r.stderr
    (tmp_path / "after" / "run" / "metrics.jsonl").unlink()
    (tmp_path / "after" / "run" / "metrics.jsonl").symlink_to(secret_file)
    r = same_runs()
    assert r.returncode == 2 and "symbolic link" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert SECRET not in r.stdout + r.stderr


def test_every_field_of_a_run_is_escaped_and_a_grid_link_is_never_a_scheme(tmp_path):
    evil = '"><meta http-equiv="refresh" content="0;url=https://example.invalid">'
    metrics = [{"event": "rollout_step", "cycle": evil, "step": 1, "rollouts": 8, "loss": 0.5},
               {"event": "eval", "split": "test", "tag": evil, "rollouts": 8, "mean": 0.2, "se": 0.01, "n": 2}]
    grid = tmp_path / "grid"
    grid.mkdir()
    a_run(grid, "javascript:alert(1)", config={"method": evil}, metrics=metrics)
    index, n = report.write_index(grid)
    page = (grid / "javascript:alert(1)" / "report.html").read_text()
    for text in (page, index.read_text()):
        assert "<meta http-equiv=\"refresh\"" not in text
    assert 'href="./javascript%3Aalert%281%29/report.html"' in index.read_text()


@pytest.mark.slow
def test_bad_bytes_and_deep_nesting_in_a_run_are_one_line_and_a_grid_skips_that_run(tmp_path):
    grid = tmp_path / "grid"
    grid.mkdir()
    good = a_run(grid, "good")
    deep = a_run(grid, "deep")
    with open(deep / "metrics.jsonl", "ab") as f:  # lines that are skipped, not a traceback
        f.write(b"[" * 100_000 + b"\n" + b'{"event": "eval", "tag": "\xff\xfe"}\n')
    assert report.render_run(run_reader.read_run(deep))
    bad = a_run(grid, "bad")
    (bad / "config.json").write_bytes(b'{"method": "\xff')
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "config.json" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(grid)], capture_output=True, text=True)
    assert r.returncode == 0 and "bad: skipped" in r.stderr and "Traceback" not in r.stderr
    index = (grid / "index.html").read_text()
    assert "skipped" in index and "./good/report.html" in index and (good / "report.html").exists()


@pytest.mark.slow
def test_a_zip_bomb_or_a_zip_that_escapes_is_refused_before_it_fills_the_disk(tmp_path):
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("metrics.jsonl", b"\0" * (64 << 20))  # 64 MB of zeros: ~64 KB packed
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="unpacks"):
        received.extract_zip(bomb, out)
    assert sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) == 0
    many = tmp_path / "many.zip"
    with zipfile.ZipFile(many, "w") as z:
        for k in range(50):
            z.writestr(f"f{k}", b"x")
    with pytest.raises(ValueError, match="members"):
        received.extract_zip(many, tmp_path / "out2", max_members=10)
    escape = tmp_path / "escape.zip"
    with zipfile.ZipFile(escape, "w") as z:
        z.writestr("../escaped.txt", b"x")
    with pytest.raises(ValueError, match="not a path inside"):
        received.extract_zip(escape, tmp_path / "out3")
    assert not (tmp_path / "escaped.txt").exists()
    grid = tmp_path / "grid"
    (grid / "bombed").mkdir(parents=True)
    shutil.copy(bomb, grid / "bombed" / "run.zip")
    a_run(grid, "fine")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report.py"), str(grid)], capture_output=True, text=True)
    assert r.returncode == 0 and "bombed: skipped" in r.stderr and "./fine/report.html" in (grid / "index.html").read_text()


@pytest.mark.slow
def test_a_committed_run_zip_still_reads_as_before(tmp_path):
    src = ROOT / "results" / "runs" / "default"
    run = next(p for p in sorted(src.iterdir()) if p.is_dir())
    copy_run(run, tmp_path / "r")
    assert run_reader.read_run(tmp_path / "r")["summary"] == run_reader.read_run(run)["summary"]


class _Server(http.server.BaseHTTPRequestHandler):
    """Replies by path: /redirect -> 302 to another origin, /big -> 32 MB, /drip -> a byte every 0.5 s,
    /json -> a valid chat completion. Every Authorization header it sees is kept in SEEN."""
    SEEN, OTHER = [], None

    def do_GET(self):
        self.SEEN.append(self.headers.get("Authorization"))
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.OTHER}/json")
            self.end_headers()
        elif self.path == "/big":
            self.send_response(200)
            self.end_headers()
            for _ in range(32):
                self.wfile.write(b"x" * (1 << 20))
        elif self.path == "/drip":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.5)
        else:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"ok": true}')

    def log_message(self, *a):
        pass


@pytest.mark.slow
def test_an_endpoint_reply_is_capped_in_size_and_time_and_credentials_stay_with_their_origin():
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    _Server.OTHER = servers[1].server_address[1]
    base = f"http://127.0.0.1:{servers[0].server_address[1]}"
    try:
        req = urllib.request.Request(base + "/redirect", headers={"Authorization": "Bearer " + SECRET})
        with pytest.raises(urllib.error.HTTPError, match="another origin"):
            received.http_body(req, 5)
        assert _Server.SEEN.count("Bearer " + SECRET) == 1  # the second origin never got it
        with pytest.raises(ValueError, match="over"):
            received.http_body(urllib.request.Request(base + "/big"), 10, cap=1 << 20)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            received.http_body(urllib.request.Request(base + "/drip"), 1.5)
        assert time.monotonic() - t0 < 5
        assert received.loads(received.http_body(urllib.request.Request(base + "/json"), 5), "reply") == {"ok": True}
        with pytest.raises(ValueError, match="not valid JSON"):
            received.loads(b"[" * 100_000, "reply")
    finally:
        for s in servers:
            s.shutdown()


@pytest.mark.slow
def test_a_chat_template_that_loops_or_balloons_is_refused_and_a_normal_one_passes():
    ok = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert chat_format.template_probe(ok) is None
    t0 = time.monotonic()
    assert "took over" in chat_format.template_probe("{% for i in range(100000) %}{% for j in range(100000) %}x"
                                                     "{% endfor %}{% endfor %}", seconds=2)
    assert time.monotonic() - t0 < 5
    assert "MB" in chat_format.template_probe("{{ 'x' * 3000000000 }}")


@pytest.mark.slow
def test_a_model_that_asks_to_run_its_own_code_is_refused_without_a_prompt(tmp_path):
    """A bundle whose config names custom code (auto_map) for an unknown model type: loading it
    never asks "run the custom code? [y/N]" (trust_remote_code=False), never runs it, and the
    command-line check says so in one line."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "whale_evil", "architectures": ["EvilForCausalLM"],
                                               "auto_map": {"AutoConfig": "evil.EvilConfig",
                                                            "AutoModelForCausalLM": "evil.EvilForCausalLM"}}))
    pwned = tmp_path / "pwned"
    (d / "evil.py").write_text(f"open({str(pwned)!r}, 'w').write('ran')\n")
    code = ("import sys; sys.path.insert(0, %r)\nfrom lm import models\ntry:\n    models.check_model(%r)\n"
            "except models.ModelError as e:\n    print('refused:', e)\n") % (str(ROOT), str(d))
    r = subprocess.run([sys.executable, "-c", code], input="y\n", capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert "refused:" in r.stdout and "[y/N]" not in r.stdout + r.stderr, (r.stdout, r.stderr[-2000:])
    assert not pwned.exists()
