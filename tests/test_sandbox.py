"""
The harness sandbox (jail/: sandbox.py, sandbox_child.py, isolation.py, landlock.py): the hostile
suite (one attack per file, its exact outcome), the Landlock layer and process isolation, the
protocol, timeouts and deadlines, run_python, what a killed run leaves behind.
"""
import ast
import dis
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import rollout
from harness_search import harness_archive
from jail import isolation
from jail import sandbox
from jail import sandbox_child
from tests.helpers import ROOT, jobs, run_whale


# ==============================================================================================
# THE SANDBOX (sandbox.py, sandbox_child.py, isolation.py)
# ==============================================================================================
# Guarantee: harness code runs in a child process that cannot read the data or another checkout,
# reach the network, start processes, see secrets, or hang or kill the parent: every attack in
# hostile/ gets its exact expected outcome, and a normal harness still works after it. The
# kernel file layer (Landlock) is what stops the attacks that defeat the audit hook. llm() and
# tool calls cross a pipe protocol that batches concurrent rollouts, records every call exactly
# and validates every argument; rollout and batch deadlines hold, with model and tool time
# charged to the rollout that used it. run_python gives model-written code the same sandbox.

HOSTILE = sorted((ROOT / "hostile").glob("*.py"))


PWNED = Path("/tmp/whale_pwned")  # one path every attack aims at: its tests share an xdist_group ("pwned"),


# so that under pytest-xdist one test's attack never lands while another asserts it did not


CAP = 64  # max_llm_tokens used throughout


NORMAL = '''
def run(task, llm, tools):
    a = llm("q: " + task["q"])
    return tools.echo(a + "!")
'''


def fake_llm_batch(log, text="fake", delay=0.0):
    """The parent's side of llm(), for the sandbox's run_rollouts: answers every call of a batch
    with `text` after `delay` seconds, with token ids derived from the request (so the records can
    be checked exactly), and checks that nothing but the protocol's fields came over the pipe.
    log gets (time, calls) per batch."""
    def llm_batch(calls):
        log.append((time.monotonic(), calls))
        time.sleep(delay)
        out = []
        for c in calls:
            assert set(c) == {"rid", "messages", "max_tokens", "stop", "seed"}  # nothing smuggled
            assert 1 <= c["max_tokens"] <= CAP
            prompt = "".join(m["role"][0] + m["content"] for m in c["messages"])
            out.append({"text": text, "prompt_ids": [ord(ch) for ch in prompt[:8]],
                        "completion_ids": [c["seed"] % 1000, c["max_tokens"]], "finish": "stop"})
        return out
    return llm_batch


def tools_for(rid):
    """The tools of one rollout, for run_rollouts: echo, add, fail (raises) and a private name."""
    def fail(x):
        raise ValueError(f"bad {x}")
    return {"echo": lambda text: text, "add": lambda a, b=0: a + b, "fail": fail,
            "_secret": lambda: "SECRET"}


def run_sandboxed(source, n=2, log=None, task=None, **kw):
    """sandbox.run_rollouts of `source` on n jobs (tasks q0, q1, ...), with fake_llm_batch and
    tools_for unless given, and the limits used throughout this section."""
    kw = {"rollout_timeout": 1.0, "batch_timeout": 10.0, "mem_mb": 256, "max_llm_tokens": CAP, **kw}
    llm_batch = kw.pop("llm_batch", None) or fake_llm_batch([] if log is None else log)
    return sandbox.run_rollouts(source, jobs(n, **(task or {})), llm_batch, tools_for, **kw)


def our_children():
    """Pids whose parent is this process (a left-behind sandbox would show up here). A test compares
    them before and after what it runs: a child another test left (not yet reaped) is not its own."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                kids.append(int(d))
    return kids


def expectation(path, key="EXPECT"):
    m = re.search(rf"^{key}: (.*)$", path.read_text(), re.M)
    return json.loads(m.group(1)) if m else None


def check_outcome(recs, exp):
    for rec in recs:
        assert rec["status"] == exp["status"], rec
        if exp["error"] is None:
            assert rec["error"] is None, rec
        else:
            assert exp["error"] in rec["error"], rec
        if "answer" in exp:
            assert rec["answer"] == exp["answer"], rec
        if "answer_prefix" in exp:
            assert (rec["answer"] or "").startswith(exp["answer_prefix"]), rec
        if "answer_len" in exp:
            assert len(rec["answer"]) == exp["answer_len"]
        if "stdout_len" in exp:
            assert len(rec["stdout"]) == exp["stdout_len"]
        if "stdout" in exp:
            assert rec["stdout"] == exp["stdout"], rec
        if "n_calls" in exp:
            assert len(rec["calls"]) == exp["n_calls"]
        if "n_tool_calls" in exp:
            assert len(rec["tool_calls"]) == exp["n_tool_calls"]


@pytest.fixture(scope="session")
def hostile_files(tmp_path_factory):
    """What the file-system attacks go after, outside the repository and world-readable (as a
    WHALE_DATA copy or a second checkout would be): {"data": dir, "checkout": dir}, both in the task."""
    root = Path(f"/tmp/whale_hostile_{os.getpid()}")
    data, checkout = root / "data" / "searchqa", root / "checkout" / "data" / "searchqa"
    for d in (data, checkout):
        d.mkdir(parents=True, exist_ok=True)
        (d / "test.jsonl.gz").write_bytes((ROOT / "data" / "searchqa" / "test.jsonl.gz").read_bytes())
    (root / "checkout" / "sandbox.py").write_bytes((ROOT / "jail" / "sandbox.py").read_bytes())
    for dirpath, dirs, files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    yield {"data": str(root / "data"), "checkout": str(root / "checkout")}
    shutil.rmtree(root, ignore_errors=True)


def timed(llm_batch, times):
    def timed_batch(calls):
        t = time.monotonic()
        try:
            return llm_batch(calls)
        finally:
            times.append(time.monotonic() - t)
    return timed_batch


# ---- the hostile suite: one attack per file, its exact outcome, then a normal harness still works ----

ISSUE_20_ATTACKS = {"read_data_copy", "read_other_checkout", "sqlite_attach", "sqlite_vacuum_into",
                    "mutate_hook_tables", "deep_tool_args", "deep_tool_args_forged", "huge_token_prompt",
                    "llm_flood"}


ISSUE_35_TEXT_PATHS = {"surrogate_prompt", "surrogate_system_message", "surrogate_tool_args", "surrogate_output",
                       "surrogate_error", "surrogate_load_error"}  # one per way text gets from a child to the parent


def test_hostile_suite_is_complete():
    # test_hostile_harness runs every file in hostile/ (nothing there is left out by its name)
    assert [p.name for p in HOSTILE] == sorted(p.name for p in (ROOT / "hostile").iterdir())
    assert ISSUE_20_ATTACKS | ISSUE_35_TEXT_PATHS <= {p.stem for p in HOSTILE}
    for path in HOSTILE:  # test_hostile_harness runs every one of these files
        doc = path.read_text().split('"""')[1]
        assert doc.startswith("Attack"), path.name
        assert expectation(path) is not None, path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", HOSTILE, ids=lambda p: p.stem)
def test_hostile_harness(path, monkeypatch, hostile_files, request):
    monkeypatch.setenv("WHALE_TEST_SECRET", "hunter2")  # must never reach the child
    monkeypatch.delenv("WHALE_SANDBOX_NO_LANDLOCK", raising=False)
    PWNED.unlink(missing_ok=True)
    exp = expectation(path)
    if exp.get("needs") == "landlock" and not isolation.plan()["landlock_abi"]:
        pytest.skip(f"no Landlock here ({isolation.plan()['landlock_off']})")
    log, times = [], []
    real = exp.get("engine") == "real"  # attacks on the model itself go to the real engine
    if real:
        llm_batch = rollout.make_llm_batch(request.getfixturevalue("hf"), {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, CAP)
    else:
        llm_batch = fake_llm_batch(log)
    timeout = exp.get("rollout_timeout", 1.0)
    t0, before = time.monotonic(), set(our_children())
    recs = run_sandboxed(path.read_text(), n=2, llm_batch=timed(llm_batch, times), task=hostile_files,
                         rollout_timeout=timeout)
    assert time.monotonic() - t0 < 8.0
    check_outcome(recs, exp)
    for rec in recs:
        assert "hunter2" not in json.dumps(rec)
        for call in rec["calls"]:  # whatever the harness did, recorded calls are what the parent sampled
            assert len(call["completion_ids"]) <= CAP if real else (call["text"] == "fake" and call["completion_ids"][1] <= CAP)
        if rec["status"] == "timeout":  # model time counts: a flood overruns its deadline by one batch at most
            assert rec["charged_s"] <= timeout + max(times, default=0.0) + 0.25, rec
        json.dumps(harness_archive.drop_token_ids(rec), default=str)  # phase B writes every record like this
        json.dumps(rec, ensure_ascii=False).encode("utf-8")  # every string in it is valid Unicode (surrogate_*.py)
    assert not PWNED.exists()
    assert set(our_children()) <= before  # the sandbox process was killed and reaped
    # the parent is alive (we are running) and the machinery still works
    recs = run_sandboxed(NORMAL, n=2)
    assert [(r["status"], r["answer"]) for r in recs] == [("ok", "fake!"), ("ok", "fake!")]


BYPASS = [p for p in HOSTILE if expectation(p, "EXPECT_WITHOUT_LANDLOCK")]


@pytest.mark.slow
@pytest.mark.parametrize("path", BYPASS, ids=lambda p: p.stem)
def test_without_landlock_the_attack_gets_through(path, monkeypatch, hostile_files):
    """The same attacks with the kernel file layer switched off (a test-only variable) succeed:
    so the audit hook really is defeated (or never sees them), and Landlock is what stops them."""
    monkeypatch.setenv("WHALE_SANDBOX_NO_LANDLOCK", "1")
    PWNED.unlink(missing_ok=True)
    exp = expectation(path, "EXPECT_WITHOUT_LANDLOCK")
    if isolation.plan()["hidden"] and not isolation.plan()["namespaces"]:
        pytest.skip("the child stays root here: nothing to compare with")
    try:
        check_outcome(run_sandboxed(path.read_text(), n=2, task=hostile_files,
                                    rollout_timeout=exp.get("rollout_timeout", 1.0)), exp)
        assert PWNED.exists() == bool(exp.get("pwned"))
    finally:
        PWNED.unlink(missing_ok=True)


# ---- the Landlock layer and process isolation --------------------------------------------------

def _python_nobody_can_run():
    """An interpreter 'nobody' can start (the one running the tests may live under /root)."""
    for exe in (sys.executable, "/usr/bin/python3"):
        if not os.path.exists(exe):
            continue
        stdlib = subprocess.run([exe, "-S", "-c", "import os; print(os.path.dirname(os.__file__))"],
                                capture_output=True, text=True).stdout.strip()
        if stdlib and not isolation.unsearchable_ancestor(os.path.realpath(exe)) \
                and not isolation.unsearchable_ancestor(stdlib):
            return exe
    return None


def _run_as_nobody(harness, task, env=()):
    """run_rollouts in a separate parent process that is not root (uid 65534), 2 rollouts."""
    exe = _python_nobody_can_run()
    if os.geteuid() != 0 or exe is None:
        pytest.skip("needs root (to start a non-root parent) and an interpreter nobody can run")
    code = tempfile.mkdtemp(prefix="whale_nonroot_", dir="/tmp")
    try:
        os.chmod(code, 0o755)
        os.mkdir(Path(code, "jail"), 0o755)  # the sandbox's package, as nobody may read it
        for name, text in (*((f"jail/{f}", (ROOT / "jail" / f).read_text()) for f in ("__init__.py", "sandbox.py",
                             "sandbox_child.py", "isolation.py", "landlock.py")), ("harness.py", harness)):
            Path(code, name).write_text(text)
            os.chmod(Path(code, name), 0o644)
        script = textwrap.dedent(f"""
            import json, os, sys
            sys.path.insert(0, {code!r})
            from jail import sandbox
            jobs = [{{"rid": i, "task": {task!r}, "seed": i}} for i in range(2)]
            recs = sandbox.run_rollouts(open({code!r} + "/harness.py").read(), jobs, lambda calls: [],
                                        lambda rid: {{}}, rollout_timeout=5.0, mem_mb=256)
            print(json.dumps({{"uid": os.getuid(), "recs": recs}}))""")

        def drop():
            os.setgroups([])
            os.setgid(isolation.NOBODY)
            os.setuid(isolation.NOBODY)
        r = subprocess.run([exe, "-c", script], cwd=code, preexec_fn=drop, capture_output=True, text=True,
                           timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": code, **dict(env)})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr
    finally:
        shutil.rmtree(code, ignore_errors=True)


@pytest.mark.slow
def test_landlock_binds_when_the_parent_is_not_root(hostile_files):
    if not isolation.plan()["landlock_abi"]:
        pytest.skip("no Landlock here")
    path = ROOT / "hostile" / "read_data_copy.py"
    out, _ = _run_as_nobody(path.read_text(), hostile_files)
    assert out["uid"] == isolation.NOBODY
    check_outcome(out["recs"], expectation(path))  # the kernel refused
    out, err = _run_as_nobody(path.read_text(), hostile_files, env={"WHALE_SANDBOX_NO_LANDLOCK": "1"})
    check_outcome(out["recs"], expectation(path, "EXPECT_WITHOUT_LANDLOCK"))  # nobody may read it otherwise
    assert err.count("kernel file layer") == 1  # said once, on stderr


@pytest.mark.slow
def test_landlock_binds_when_the_child_stays_root(monkeypatch, hostile_files):
    """Root without a mount namespace (a container without CAP_SYS_ADMIN): if nobody cannot reach
    the interpreter the child stays root, and Landlock is the file layer that still holds."""
    if os.geteuid() != 0 or not isolation.plan()["landlock_abi"]:
        pytest.skip("needs root and Landlock")
    monkeypatch.setitem(isolation.plan(), "namespaces", False)
    who = run_sandboxed("import os\ndef run(task, llm, tools):\n    return str(os.getuid())\n", n=1)[0]["answer"]
    for name in ("read_data_copy", "read_proc_bypass", "sqlite_attach"):
        path = ROOT / "hostile" / f"{name}.py"
        exp = expectation(path)
        check_outcome(run_sandboxed(path.read_text(), n=2, task=hostile_files,
                                    rollout_timeout=exp.get("rollout_timeout", 1.0)), exp)
    assert not PWNED.exists()
    if who == "0":  # and without it, root reads everything once the hook is defeated
        monkeypatch.setenv("WHALE_SANDBOX_NO_LANDLOCK", "1")
        path = ROOT / "hostile" / "read_data_copy.py"
        check_outcome(run_sandboxed(path.read_text(), n=2, task=hostile_files, rollout_timeout=5.0),
                      expectation(path, "EXPECT_WITHOUT_LANDLOCK"))


@pytest.mark.slow
def test_landlock_off_is_said_once(monkeypatch, capfd):
    monkeypatch.setattr(isolation, "_WARNED", set())
    monkeypatch.setenv("WHALE_SANDBOX_NO_LANDLOCK", "1")
    for _ in range(2):
        assert sandbox.run_python("print(1)") == {"stdout": "1\n", "error": None}
    err = capfd.readouterr().err
    assert err.count("sandbox: WARNING") == 1 and "kernel file layer (Landlock) is off" in err


def test_the_tmpfs_covers_hide_the_repository_and_cwd_but_no_system_dir_nor_scratch(tmp_path, monkeypatch):
    """isolation.covers: what an empty tmpfs goes over in the harness child's mount namespace. The
    repository and the parent's cwd are covered, once each (a directory inside another covered one
    is not mounted twice); never a system directory or one that holds one (the child needs /usr,
    /tmp ...), nor a directory that holds scratch (the mount would hide scratch itself)."""
    repo, cwd = tmp_path / "repo", tmp_path / "repo" / "runs"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    p = dict(repo=str(repo), hidden=None)
    assert isolation.covers(p, "/tmp/whale_sbx_1-x") == [str(repo)]  # cwd lies inside repo
    monkeypatch.chdir("/usr")
    assert isolation.covers(dict(p, hidden="/root"), "/tmp/whale_sbx_1-x") == sorted([str(repo), "/root"])
    assert isolation.covers(dict(p, repo="/usr"), "/tmp/whale_sbx_1-x") == []
    assert isolation.covers(p, str(repo / "scratch")) == []  # scratch inside the repo: not covered
    assert isolation.covers(dict(p, repo="/"), "/tmp/whale_sbx_1-x") == []


def test_the_audit_hook_reads_nothing_a_harness_can_reach(tmp_path):
    """The hook's inputs are bound, immutable default arguments: no globals, no builtins looked up
    at call time, no closure cells, no Python helper (os.path.realpath) that could be swapped."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "etc").symlink_to("/etc")
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    hook = sandbox_child._make_audit_hook(str(scratch), (stdlib,), (stdlib + "/site-packages",))
    assert hook.__closure__ is None
    assert not {i.opname for i in dis.get_instructions(hook)} & {
        "LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF", "STORE_GLOBAL", "MAKE_FUNCTION"}

    def frozen(x):
        if isinstance(x, (tuple, frozenset)):
            return all(map(frozen, x))
        return x is None or type(x) in (str, int, bool, type(len)) or (
            isinstance(x, type) and x.__module__ == "builtins")
    assert all(map(frozen, hook.__defaults__)), hook.__defaults__
    # and it still means what it says: symlinks and .. resolved, writes only in scratch
    cwd = os.getcwd()
    os.chdir(scratch)
    try:
        hook("open", ("notes.txt", "w", 0))
        hook("open", (os.path.join(stdlib, "os.py"), "r", 0))
        for args in (("etc/passwd", "r", 0), ("sub/../../x", "r", 0), (os.path.join(stdlib, "os.py"), "a", 0),
                     (stdlib + "/site-packages/x.py", "r", 0), (b"/etc/passwd", None, os.O_RDONLY)):
            with pytest.raises(PermissionError, match="sandbox: access to"):
                hook("open", args)
        with pytest.raises(PermissionError, match="opening directories"):
            hook("open", (".", "r", 0))
        with pytest.raises(PermissionError, match="blocked"):
            hook("os.rename", ("notes.txt", "/tmp/x", None, None))
    finally:
        os.chdir(cwd)


@pytest.mark.slow
def test_isolation_when_root():
    if os.geteuid() != 0:
        pytest.skip("uid drop and namespaces need root")
    src = '''
import os, resource
def run(task, llm, tools):
    try:
        os.stat(task["repo"] + "/jail/sandbox.py")  # stat is not audited: this asks the kernel
        repo = "visible"
    except OSError as e:
        repo = type(e).__name__
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)
    return "|".join([str(os.getuid()), str(os.getgid()), str(nproc), repo])
'''
    rec = run_sandboxed(src, n=1)[0]
    uid, gid, nproc, repo = rec["answer"].split("|")
    if not isolation.PLAN["namespaces"] and isolation.PLAN["hidden"]:
        pytest.skip("no mount namespace here and nobody cannot reach the interpreter: child stays root")
    assert (uid, gid) == ("65534", "65534")  # not root, so RLIMIT_NPROC binds in the kernel
    assert nproc == "(0, 0)"
    if isolation.PLAN.get("namespaces"):
        assert repo == "FileNotFoundError"  # the repo is covered by an empty tmpfs in the child


# ---- the protocol: one llm batch per round, exact records, tool calls, argument checks ---------

TWO_CALLS = '''
def run(task, llm, tools):
    a = llm("first " + task["q"])
    print("got", a)
    b = llm([{"role": "system", "content": "sys"}, {"role": "user", "content": a + task["q"]}],
            max_tokens=7, stop="\\n")
    return b
'''


@pytest.mark.slow
def test_concurrent_rollouts_share_one_llm_batch_and_are_recorded_exactly():
    n = 16
    log = []
    recs = run_sandboxed(TWO_CALLS, n=n, log=log)
    assert [len(calls) for _, calls in log] == [n, n]  # every llm() round is ONE batch of all rollouts
    for r, rec in enumerate(recs):
        assert rec["rid"] == 100 + r and rec["status"] == "ok" and rec["error"] is None
        assert rec["answer"] == "fake" and rec["stdout"] == "got fake\n"
        s0, s1 = sandbox._call_seed(r, 0), sandbox._call_seed(r, 1)
        m0 = [{"role": "user", "content": f"first q{r}"}]
        m1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": f"fakeq{r}"}]
        assert rec["calls"] == [
            {"messages": m0, "prompt_ids": [ord(c) for c in f"ufirst q{r}"[:8]],
             "completion_ids": [s0 % 1000, CAP], "text": "fake", "finish": "stop"},
            {"messages": m1, "prompt_ids": [ord(c) for c in f"ssysufakeq{r}"[:8]],
             "completion_ids": [s1 % 1000, 7], "text": "fake", "finish": "stop"}]
        assert rec["tool_calls"] == []
    first, second = log[0][1], log[1][1]
    assert [c["rid"] for c in first] == [100 + r for r in range(n)]
    assert first[0]["stop"] == [] and second[0]["stop"] == ["\n"] and second[0]["max_tokens"] == 7
    assert first[0]["max_tokens"] == CAP  # the harness's default 256, capped by the parent
    # per-call seeds are a function of (job seed, call index) only: same again on a rerun
    again = run_sandboxed(TWO_CALLS, n=n)
    strip = lambda rs: [{k: v for k, v in x.items() if k not in ("wall_s", "charged_s", "model_s")} for x in rs]
    assert strip(again) == strip(recs)
    assert len({c["seed"] for _, calls in log for c in calls}) == 2 * n


@pytest.mark.slow
def test_tool_calls_are_answered_and_recorded():
    src = '''
def run(task, llm, tools):
    total = tools.add(2, b=3)
    try:
        tools.fail("x")
    except ToolError as e:
        msg = str(e)
    return f"{total}|{msg}|{tools.echo([1, {'a': None}])}"
'''
    rec = run_sandboxed(src, n=1)[0]
    assert rec["status"] == "ok" and rec["answer"] == "5|ValueError: bad x|[1, {'a': None}]"
    assert rec["tool_calls"] == [
        {"name": "add", "args": [2], "kwargs": {"b": 3}, "result": "5", "error": None},
        {"name": "fail", "args": ["x"], "kwargs": {}, "result": None, "error": "ValueError: bad x"},
        {"name": "echo", "args": [[1, {"a": None}]], "kwargs": {}, "result": '[1, {"a": null}]', "error": None}]


@pytest.mark.slow
def test_llm_arguments_are_validated_and_calls_are_budgeted():
    src = '''
def run(task, llm, tools):
    out = []
    for bad in ([{"role": "tool", "content": "x"}], [], 5, [{"role": "user", "content": 3}]):
        try:
            llm(bad)
        except ToolError as e:
            out.append("bad")
    for kw in ({"max_tokens": 0}, {"max_tokens": True}, {"stop": [1]}):
        try:
            llm("hi", **kw)
        except ToolError:
            out.append("bad")
    n = 0
    try:
        while True:
            llm("again")
            n += 1
    except ToolError as e:
        out.append(str(n))
    return ",".join(out)
'''
    rec = run_sandboxed(src, n=1, max_llm_calls=10)[0]  # the 7 invalid attempts count too
    assert rec["status"] == "ok" and rec["answer"] == "bad,bad,bad,bad,bad,bad,bad,3"
    assert len(rec["calls"]) == 3


@pytest.mark.slow
def test_llm_n_replies_are_n_calls_in_one_batch_with_the_seeds_of_n_separate_calls():
    """llm(..., n=k): k replies to one prompt in ONE batch (so the engine prefills it once), each
    recorded as a call with the seed the k-th separate llm() call would get, k calls of the
    budget; a bad n is refused like any bad argument."""
    votes = '''
def run(task, llm, tools):
    out = []
    for bad in (0, 17, True, "3", 2.0):
        try:
            llm("hi", n=bad)
        except ToolError:
            out.append("bad")
    one = llm("first")
    three = llm("vote", n=3)
    try:
        llm("more", n=4)  # 5 refused + 1 + 3 = 9 of 11 calls; this attempt is the 10th: 4 is over
    except ToolError as e:
        out.append("budget" if "budget" in str(e) else str(e))
    return ",".join(out) + "|" + repr(one) + "|" + repr(three) + "|" + repr(llm("last", n=1))
'''
    log = []
    rec = run_sandboxed(votes, n=1, log=log, max_llm_calls=11)[0]
    assert rec["status"] == "ok", rec
    assert rec["answer"] == "bad,bad,bad,bad,bad,budget|'fake'|['fake', 'fake', 'fake']|['fake']"
    assert [len(calls) for _, calls in log] == [1, 3, 1]  # the 3 replies went out together
    separate = '''
def run(task, llm, tools):
    return ",".join(llm(p) for p in ("first", "vote", "vote", "vote", "last"))
'''
    rec2 = run_sandboxed(separate, n=1)[0]
    assert [c["completion_ids"] for c in rec["calls"]] == [c["completion_ids"] for c in rec2["calls"]]  # seeds
    assert [c["messages"][-1]["content"] for c in rec["calls"]] == ["first", "vote", "vote", "vote", "last"]


@pytest.mark.slow
def test_print_is_captured_per_rollout_and_scratch_is_private_and_removed():
    src = '''
import os
def run(task, llm, tools):
    with open(task["q"] + ".txt", "w") as f:
        f.write(task["q"])
    print("I am", task["q"])
    return os.getcwd() + "|" + open(task["q"] + ".txt").read()
'''
    recs = run_sandboxed(src, n=3)
    for r, rec in enumerate(recs):
        cwd, note = rec["answer"].split("|")
        assert rec["stdout"] == f"I am q{r}\n"
        assert note == f"q{r}"
        assert not os.path.exists(cwd)  # scratch is deleted afterwards


SHARING = '''
import os
import sys
import threading
SEEN = []
def run(task, llm, tools):
    notes = []
    SEEN.append(task["q"])  # a module global
    notes.append(f"globals:{len(SEEN)}")
    sys.shared = getattr(sys, "shared", 0) + 1  # a module every rollout imports
    notes.append(f"modules:{sys.shared}")
    with open("note.txt", "a") as f:  # a file in its writable space
        f.write(task["q"])
    notes.append("file:" + open("note.txt").read())
    mine = os.path.basename(os.getcwd())
    siblings = [f"../r{k}/note.txt" for k in range(4) if f"r{k}" != mine]
    for path in ["..", "/tmp", *siblings]:  # the other rollouts' places, the machine's /tmp
        try:
            os.listdir(path) if os.path.isdir(path) else open(path).read()
            notes.append("reached " + path)
        except OSError:
            notes.append("refused")
    try:  # a thread that would outlive the rollout and carry its answers on
        threading.Thread(target=lambda: None).start()
        notes.append("thread started")
    except RuntimeError:
        notes.append("thread refused")
    llm("hi")
    return "|".join(notes)
'''


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [None, 1])
def test_no_state_of_one_rollout_reaches_another(concurrency):
    """Globals, modules, files in its own or a sibling's place, threads: each rollout starts from
    the harness file alone, whether the rollouts run at once or one after another."""
    recs = run_sandboxed(SHARING, n=4, concurrency=concurrency)
    assert [r["answer"] for r in recs] == [f"globals:1|modules:1|file:q{r}|" + "refused|" * 5 + "thread refused"
                                           for r in range(4)], recs


@pytest.mark.slow
def test_the_rollout_processes_of_a_batch_are_held_to_its_memory_together():
    """Each rollout process has its own address-space cap (mem_mb); all of them together are
    held to mem_mb too: while the sum is over it, the largest is killed, the rest go on."""
    src = '''
import time
def run(task, llm, tools):
    hog = bytearray(100 << 20)  # 100 MB each, under the per-process cap; 400 MB for the four
    for k in range(0, len(hog), 4096):
        hog[k] = 1
    t = time.monotonic()
    while time.monotonic() - t < 1.0:
        time.sleep(0.05)
    return "kept"
'''
    recs = run_sandboxed(src, n=4, mem_mb=256, rollout_timeout=5.0)
    killed = [r for r in recs if r["status"] == "crash"]
    assert 2 <= len(killed) <= 3 and all("held over 256 MB together" in r["error"] for r in killed), recs
    assert all((r["status"], r["answer"]) == ("ok", "kept") for r in recs if r["status"] != "crash")


GUESSING = '''
TRIED = {}  # what earlier rollouts of the same task learnt from the tool: a shared harness would use it
def run(task, llm, tools):
    llm("pick one")
    for guess in ("a", "b", "c", "d"):
        if SHARE and TRIED.get((task["name"], guess)) == "wrong":
            continue
        verdict = tools.check(guess)  # like chess's play(): the tool tells a wrong try, and ends the rollout
        TRIED[(task["name"], guess)] = verdict
        return guess
'''


@pytest.mark.slow
def test_pooling_tool_answers_across_samples_scores_what_the_same_harness_scores_without():
    """The attack of issue 66: samples of one task pool what a tool told them (chess's play(): a
    wrong move) and take turns. With one process per rollout, the harness that tries to share
    scores exactly what the same harness scores with sharing off: mean@k stays a mean of
    independent tries."""
    secret = "d"

    def tools(rid):
        return {"check": lambda guess: "right" if guess == secret else "wrong"}

    def score(source):
        recs = sandbox.run_rollouts(source, jobs(8, name="the same task"), fake_llm_batch([]), tools,
                                    rollout_timeout=2.0, concurrency=1, max_llm_tokens=CAP)
        return [r["answer"] == secret for r in recs]
    shared, alone = score("SHARE = True\n" + GUESSING), score("SHARE = False\n" + GUESSING)
    assert shared == alone == [False] * 8


@pytest.mark.slow
def test_llm_batch_can_refuse_one_call():
    src = """
def run(task, llm, tools):
    try:
        return llm("bad " + task["q"])
    except ToolError as e:
        return "refused: " + str(e)
"""
    inner = fake_llm_batch([])

    def llm_batch(calls):
        outs = inner(calls)
        return [{"error": "too long"} if c["messages"][0]["content"] == "bad q1" else o for c, o in zip(calls, outs)]
    r0, r1 = run_sandboxed(src, n=2, llm_batch=llm_batch)
    assert (r0["answer"], len(r0["calls"])) == ("fake", 1)
    assert (r1["status"], r1["answer"], r1["calls"]) == ("ok", "refused: llm: too long", [])


# ---- timeouts and deadlines --------------------------------------------------------------------

@pytest.mark.slow
def test_one_hung_rollout_times_out_and_the_others_finish():
    src = '''
import time
def run(task, llm, tools):
    if task["q"] == "q0":
        time.sleep(60)
    return llm("hi")
'''
    t0 = time.monotonic()
    recs = run_sandboxed(src, n=4)
    assert time.monotonic() - t0 < 4
    assert [r["status"] for r in recs] == ["timeout", "ok", "ok", "ok"]
    assert "rollout timeout" in recs[0]["error"] and recs[0]["answer"] is None


@pytest.mark.slow
def test_a_slow_rollout_does_not_stall_the_batch():
    src = '''
import time
def run(task, llm, tools):
    if task["q"] == "q0":
        time.sleep(0.6)
    return llm("hi")
'''
    log = []
    recs = run_sandboxed(src, n=4, log=log)
    assert all(r["status"] == "ok" for r in recs)
    batches = [[c["rid"] for c in calls] for _, calls in log]
    assert batches[-1] == [100]  # the fast three went out without waiting for the slow one
    assert sorted(sum(batches[:-1], [])) == [101, 102, 103]
    assert log[-1][0] - log[0][0] > 0.3


@pytest.mark.slow
def test_model_time_is_charged_by_share_of_each_batch():
    log = []
    recs = run_sandboxed(TWO_CALLS, n=3, llm_batch=fake_llm_batch(log, delay=1.2), rollout_timeout=1.0,
                         batch_timeout=2.0)
    assert [r["status"] for r in recs] == ["ok"] * 3  # 2 batches of 1.2 s shared by 3 rollouts: 0.8 s each
    assert all(0.8 <= r["charged_s"] < 1.0 for r in recs), [r["charged_s"] for r in recs]
    assert all(0.8 <= r["model_s"] <= r["charged_s"] for r in recs), recs  # and said apart from the rest


@pytest.mark.slow
def test_an_llm_flood_stops_within_one_batch_of_its_deadline():
    src = 'def run(task, llm, tools):\n    while True:\n        llm("again")\n'
    log = []
    t0 = time.monotonic()
    rec = run_sandboxed(src, n=1, llm_batch=fake_llm_batch(log, delay=0.3), rollout_timeout=1.0, max_llm_calls=1000)[0]
    assert rec["status"] == "timeout" and "rollout timeout" in rec["error"]
    assert 1.0 < rec["charged_s"] <= 1.0 + 0.3 + 0.2 and len(rec["calls"]) == len(log) <= 4
    assert time.monotonic() - t0 < 1.0 + 0.3 + 2.0  # wall time too (startup included)


@pytest.mark.slow
def test_tool_time_is_charged_to_the_rollout_that_called():
    src = 'def run(task, llm, tools):\n    if task["q"] == "q0":\n        while True:\n            tools.slow()\n    return llm("hi")\n'
    rec0, rec1 = sandbox.run_rollouts(src, jobs(2), fake_llm_batch([]), lambda rid: {"slow": lambda: time.sleep(0.3)},
                                      rollout_timeout=1.0, max_llm_tokens=CAP)
    assert rec0["status"] == "timeout" and 1.0 < rec0["charged_s"] <= 1.5 and len(rec0["tool_calls"]) <= 4
    assert rec1["status"] == "ok" and rec1["charged_s"] < 0.5  # the other rollout does not pay for them
    assert rec0["model_s"] == 0.0  # tool time is the harness's own, never the model's


@pytest.mark.slow
def test_batch_timeout():
    src = 'def run(task, llm, tools):\n    while True:\n        pass\n'
    recs = run_sandboxed(src, n=2, rollout_timeout=30.0, batch_timeout=1.0)
    assert [r["status"] for r in recs] == ["timeout", "timeout"]
    assert all("batch timeout" in r["error"] for r in recs)


@pytest.mark.slow
def test_concurrency_limit_queues_rollouts_and_hung_rollouts_do_not_hang_the_queue():
    log = []
    recs = run_sandboxed(TWO_CALLS, n=6, log=log, concurrency=2)
    assert all(r["status"] == "ok" for r in recs)
    assert max(len(calls) for _, calls in log) <= 2
    hang = 'def run(task, llm, tools):\n    while True:\n        pass\n'
    t0 = time.monotonic()
    recs = run_sandboxed(hang, n=4, concurrency=2)  # each is killed at its deadline, its place goes on
    assert [r["status"] for r in recs] == ["timeout"] * 4
    assert all("rollout timeout" in r["error"] for r in recs)
    assert time.monotonic() - t0 < 2 * 1.0 + 2.0  # two rounds of 1 s deadlines, startup included


@pytest.mark.slow
def test_a_late_finisher_frees_its_worker_for_the_queue():
    src = '''
import time
def run(task, llm, tools):
    if task["q"] == "q0":
        time.sleep(1.5)  # times out at 1.0 s, then its thread picks up the next job
    return llm("hi")
'''
    recs = run_sandboxed(src, n=3, concurrency=1)
    assert [r["status"] for r in recs] == ["timeout", "ok", "ok"]


# ---- run_python: the same sandbox for model-written code (the math domain's python tool) -------

@pytest.mark.slow
def test_run_python():
    before = set(our_children())
    assert sandbox.run_python("print(6 * 7)") == {"stdout": "42\n", "error": None}
    assert sandbox.run_python("print('a')\n1 / 0") == {"stdout": "a\n", "error": "ZeroDivisionError: division by zero"}
    assert sandbox.run_python("raise SystemExit(0)") == {"stdout": "", "error": None}
    assert sandbox.run_python("print('x' * 10000)", max_output=100)["stdout"] == "x" * 100
    assert "SyntaxError" in sandbox.run_python("print 1")["error"]
    assert "MemoryError" in sandbox.run_python("x = bytearray(4 << 30)", mem_mb=256)["error"]
    assert "is blocked" in sandbox.run_python("open('/etc/passwd').read()")["error"]
    assert "os.fork is blocked" in sandbox.run_python("import os\nos.fork()")["error"]
    assert "socket" in sandbox.run_python("import socket\nsocket.socket()")["error"]
    # text from model-written code, as from a harness: a lone surrogate is kept as U+FFFD (issue 35)
    assert sandbox.run_python("print('\\udfff')\nraise ValueError('\\ud800')") == {"stdout": "\ufffd\n",
                                                                                 "error": "ValueError: \ufffd"}
    t0 = time.monotonic()
    out = sandbox.run_python("while True:\n    pass", timeout_s=0.5)
    assert out["error"].startswith("TimeoutError") and time.monotonic() - t0 < 3
    assert set(our_children()) <= before


@pytest.mark.slow
def test_run_python_child_holds_the_child_code_and_nothing_of_the_parent():
    """The child runs sandbox_child.py alone: its __main__ module, which a harness can reach through
    sys.modules, holds the protocol, the lock-down and the hook's inputs, never the parent's
    spawning code (the plan with libc, the isolation steps, run_rollouts) nor a module of WHALE."""
    code = ("import sys\nm = sys.modules['__main__']\n"
            "print(sorted(k for k in vars(m) if not k.startswith('__')))\n"
            "print(sorted(k for k in sys.modules if k in ('sandbox', 'isolation', 'landlock', 'engine', 'rollout', 'whale')))")
    out = sandbox.run_python(code, max_output=4000)
    assert out["error"] is None, out
    names, whale_modules = (ast.literal_eval(line) for line in out["stdout"].splitlines())
    assert {"_child_main", "_lock_down", "_make_audit_hook", "frame", "valid_text"} <= set(names)
    assert not set(names) & {"plan", "PLAN", "preexec", "mounts", "_Child", "run_rollouts", "run_python"}
    assert whale_modules == []


# ---- what a killed run leaves behind: its scratch dirs, its records -----------------------------

def scratch_dirs(pid):
    return sorted(Path(tempfile.gettempdir()).glob(f"{sandbox.SCRATCH_PREFIX}{pid}-*"))


@pytest.mark.slow
def test_scratch_of_a_killed_parent_is_removed_by_the_next_clean_and_no_other():
    """A parent killed with SIGKILL mid-batch cannot remove its sandbox's scratch dir (its child
    dies with it); clean_dead_scratch removes it, and leaves a live process's dir (this one's, as
    a run going on next to it) and one named without a pid alone."""
    sleeper = "import time\ndef run(task, llm, tools):\n    time.sleep(60)\n"
    parent = subprocess.Popen([sys.executable, "-c", "from jail import sandbox; sandbox.run_rollouts("
                               f"{sleeper!r}, [{{'rid': 0, 'task': {{}}, 'seed': 0}}], None, lambda rid: {{}}, "
                               "rollout_timeout=60)"], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not scratch_dirs(parent.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the child is running the harness
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    dead = scratch_dirs(parent.pid)
    assert len(dead) == 1
    live = Path(tempfile.mkdtemp(prefix=f"{sandbox.SCRATCH_PREFIX}{os.getpid()}-"))
    # named before pids were in the name, by a run of older code that may be alive: its random
    # part may start like a pid of a process that is gone ("12_ab3x9q")
    unnamed = Path(tempfile.mkdtemp(prefix=f"{sandbox.SCRATCH_PREFIX}{2 ** 22 + 1}_"))
    try:
        removed = sandbox.clean_dead_scratch()
        assert str(dead[0]) in removed and not dead[0].exists()
        assert live.exists() and unnamed.exists()
    finally:
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(unnamed, ignore_errors=True)


@pytest.mark.slow
def test_hostile_prompt_through_whale_eval_killed_then_resumed_and_its_scratch_removed(tmp_path):
    """Issue 35 end to end: `whale.py --method eval --harness H` with llm("Say yes. \\ud800") in H
    crashed after 11 s (the tokenizer's TypeError), and so did every --resume. Now the call is a
    ToolError in the harness; a run killed with SIGKILL in its first model batch resumes to the
    end, and the resume removes the scratch dir the killed run's sandbox left in /tmp."""
    h = tmp_path / "h.py"  # (a new source every time: a cached initial evaluation would sample nothing)
    h.write_text(f'# {time.time_ns()}\ndef run(task, llm, tools):\n    try:\n        llm("Say yes. \\ud800")\n'
                 '    except ToolError as e:\n        print(e)\n    return llm("Say yes.")\n')
    out = tmp_path / "run"
    args = ["--method", "eval", "--harness", str(h), "--test-limit", "2", "--test-n", "1", "--max-tokens", "8"]
    killed = subprocess.Popen([sys.executable, str(ROOT / "whale.py"), *args, "--out", str(out)], cwd=ROOT,
                              env={**os.environ, "WHALE_CRASH_AT": "sampling:1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, err[-2000:]
    assert len(scratch_dirs(killed.pid)) == 1  # what the killed run's sandbox left
    r = run_whale("--resume", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert scratch_dirs(killed.pid) == []
    s = json.loads((out / "summary.json").read_text())
    assert s["method"] == "eval" and s["test_mean8_final"] == s["test_mean8_initial"]
