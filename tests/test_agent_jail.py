"""
The coding agent's jail (jail/agent_jail.py, harness_search/agent_proposer.py), as strict as the
harness sandbox: stand-in agents try each escape of issue 54 and each way to leave too much behind.
"""
import json
import os
import select
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import meta_harness as mh
from domains import searchqa
from harness_search import agent_proposer
from harness_search import archive_view
from harness_search import harness_archive
from harness_search import harness_source as hsrc
from harness_search import primitives
from jail import agent_jail
from jail import isolation
from jail import sandbox
from tests.helpers import (
    DOMAIN, EXAMPLES, H0, ROOT, archive_with_history, make_evaluate, ok_validate, quiet, run_whale,
    stop_after)


# ---- the agent jail as strict as the harness sandbox (issue 54) --------------------------------

ESCAPER = r"""
'''A stand-in agent that tries, as root in the old jail could, to get out: it prints one JSON line
{what: "ok: ..." or "refused: <error>"} per attempt, and writes a candidate so the call is normal.'''
import ctypes, fcntl, json, os, socket, sys, termios
T = json.loads(sys.argv[1])
sys.stdin.read()
out = {}
def attempt(what, fn):
    try:
        out[what] = "ok: " + str(fn())[:80]
    except OSError as e:
        out[what] = f"refused: {type(e).__name__}: {e}"
def status():
    return {k: v.strip() for k, v in (x.split(":", 1) for x in open("/proc/self/status") if ":" in x)}
def tcp(port, proto=0):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, proto) as s:
        s.settimeout(3)
        s.connect(("127.0.0.1", port))
        s.sendall(b"hi")
        return s.recv(10)
def udp(port):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(3)
        s.sendto(b"hi", ("127.0.0.1", port))
        return s.recv(10)
def unix(path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        s.connect(path)
        return s.recv(10)
def add_address():  # SIOCSIFADDR 10.9.9.9 on lo
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        import struct
        addr = struct.pack("16sH2s4s8x", b"lo", socket.AF_INET, b"\0\0", socket.inet_aton("10.9.9.9"))
        return fcntl.ioctl(s, 0x8916, addr)
def tiocsti_own():
    m, s = os.openpty()
    return fcntl.ioctl(s, termios.TIOCSTI, b"x")
def tiocsti_host():
    fd = os.open(T["host_pty"], os.O_RDWR | os.O_NOCTTY)
    return fcntl.ioctl(fd, termios.TIOCSTI, b"x")
def immutable():
    fd = os.open("new/cand_1.py", os.O_RDONLY)
    return fcntl.ioctl(fd, 0x40086602, (0x10).to_bytes(8, "little"))  # FS_IOC_SETFLAGS FS_IMMUTABLE_FL
def libc_call(name, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return 0
open("new/cand_1.py", "w").write(open("cand_000/harness.py").read() + "X = 1\n")
st = status()
out["identity"] = f"uid {os.getuid()} gid {os.getgid()} groups {os.getgroups()} CapEff {st['CapEff']} " \
                  f"CapBnd {st['CapBnd']} NoNewPrivs {st['NoNewPrivs']} Seccomp {st['Seccomp']}"
attempt("read /etc/shadow", lambda: open("/etc/shadow").read(1))
attempt("add an address to lo", add_address)
attempt("open a netlink socket", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
attempt("open a raw socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
attempt("open a packet socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
attempt("set the hostname", lambda: socket.sethostname("pwned-host"))
attempt("TCP to a local service", lambda: tcp(T["tcp"]))
attempt("MPTCP to a local service", lambda: tcp(T["tcp"], 262))
attempt("UDP to a local service", lambda: udp(T["udp"]))
attempt("a path-based UNIX socket", lambda: unix(T["unix"]))
attempt("an abstract UNIX socket", lambda: unix(T["abstract"]))
attempt("TIOCSTI into the host's terminal", tiocsti_host)
attempt("TIOCSTI into a pty of its own", tiocsti_own)
attempt("chattr +i a file", immutable)
attempt("a user namespace", lambda: libc_call("unshare", 0x10000000))
attempt("io_uring", lambda: libc_call("syscall", 425, 8, ctypes.create_string_buffer(120)))
def root_process():  # what its PID namespace shows: the relay to the proxy (root) must not be there
    for pid in filter(str.isdigit, os.listdir("/proc")):
        uid = next(int(x.split()[1]) for x in open(f"/proc/{pid}/status") if x.startswith("Uid:"))
        if uid == 0:
            return f"pid {pid} runs as root: " + open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    raise PermissionError("no process of root in its PID namespace")
attempt("see a root process", root_process)
print(json.dumps(out))
"""


def local_services(tmp_path):
    """A TCP, a UDP, a path-based and an abstract UNIX service on this machine, each answering
    b"pong" to anyone who reaches it: what the agent must not reach. Returns (ports/paths, close)."""
    socks, stop = [], threading.Event()
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    path = str(tmp_path / "service.sock")  # (under /tmp, where services keep their sockets)
    ux = socket.socket(socket.AF_UNIX)
    ux.bind(path)
    os.chmod(path, 0o777)
    ab = socket.socket(socket.AF_UNIX)
    ab.bind("\0whale-test-service")
    for s in (tcp, ux, ab):
        s.listen()
    socks += [tcp, udp, ux, ab]

    def serve():
        try:
            while not stop.is_set():
                for s in select.select(socks, [], [], 0.2)[0]:
                    if s is udp:
                        _, addr = udp.recvfrom(10)
                        udp.sendto(b"pong", addr)
                    else:
                        c, _ = s.accept()
                        c.sendall(b"pong")
                        c.close()
        except (OSError, ValueError):  # closed by close()
            pass
    threading.Thread(target=serve, daemon=True).start()

    def close():
        stop.set()
        for s in socks:
            s.close()
    return dict(tcp=tcp.getsockname()[1], udp=udp.getsockname()[1], unix=path, abstract="\0whale-test-service"), close


def agent_cell(tmp_path):
    """The agent's two directories as agent_proposer makes them: its copy (cwd) and its HOME."""
    root = Path(tempfile.mkdtemp(prefix="whale-agent-"))
    (root / "archive" / "new").mkdir(parents=True)
    (root / "home").mkdir()
    (root / "archive" / "cand_000").mkdir()
    (root / "archive" / "cand_000" / "harness.py").write_text(H0)
    return root


@pytest.mark.slow
def test_agent_jail_drops_root_and_reaches_nothing_on_this_machine(tmp_path):
    """Issue 54's escapes, tried by a stand-in agent: as uid nobody with no capabilities, no_new_privs
    and the seccomp filter, in its own network, mount and PID namespaces, every one is refused, and
    the host is as it was (hostname, lo's addresses); the services it tried were reachable from here."""
    if not isolation.plan()["root"]:
        pytest.skip("the uid drop and the namespaces need root")
    services, close = local_services(tmp_path)
    host_pty_master, host_pty = os.openpty()
    script = tmp_path / "escaper.py"
    script.write_text(ESCAPER)
    plan = dict(services, host_pty=os.ttyname(host_pty))
    root = agent_cell(tmp_path)
    hostname = socket.gethostname()
    addresses = subprocess.run(["cat", "/proc/net/if_inet6", "/proc/net/fib_trie"], capture_output=True).stdout
    try:
        assert socket.create_connection(("127.0.0.1", services["tcp"]), timeout=3).recv(10) == b"pong"  # it is there
        res = agent_jail.run_agent(f"{sys.executable} {script} {shlex.quote(json.dumps(plan))}", str(root / "archive"),
                                   str(root / "home"), "go", timeout=60)
    finally:
        close()
        os.close(host_pty_master)
        os.close(host_pty)
    assert res["rc"] == 0, res["err"][-3000:]
    out = json.loads(res["out"].strip().splitlines()[-1])
    assert out.pop("identity") == ("uid 65534 gid 65534 groups [] CapEff 0000000000000000 CapBnd 0000000000000000 "
                                   "NoNewPrivs 1 Seccomp 2")
    for what, how in out.items():
        assert how.startswith("refused: "), (what, how)
    assert "Permission denied" in out["read /etc/shadow"]
    assert "Operation not permitted" in out["open a netlink socket"] and "Operation not permitted" in out["MPTCP to a local service"]
    assert socket.gethostname() == hostname
    assert subprocess.run(["cat", "/proc/net/if_inet6", "/proc/net/fib_trie"], capture_output=True).stdout == addresses
    assert (root / "archive" / "new" / "cand_1.py").exists()
    shutil.rmtree(root)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["tmp", "repository"])
def test_the_agent_runs_from_a_venv_wherever_it_is_installed(tmp_path, where):
    """Issue 66: an agent whose interpreter is a venv under /tmp (hidden in the cell) or inside the
    repository (private: its data/ holds the test split) still starts: the jail grants its
    executable's installation as named and as resolved, and nothing else of the repository."""
    venv = tmp_path / "venv" if where == "tmp" else ROOT / f".venv-jail-test-{os.getpid()}"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        script = tmp_path / "agent.py"
        script.write_text("import sys\nsys.stdin.read()\n"
                          "open('new/cand_1.py', 'w').write(open('cand_000/harness.py').read() + 'X = 1\\n')\n"
                          "try:\n"
                          f"    open({str(ROOT / 'data' / 'searchqa' / 'test.jsonl.gz')!r}, 'rb').read(1)\n"
                          "    data = 'read'\n"
                          "except OSError:\n"
                          "    data = 'refused'\n"
                          "print(sys.prefix, data)\n")
        root = agent_cell(tmp_path)
        res = agent_jail.run_agent(f"{venv}/bin/python3 {script}", str(root / "archive"), str(root / "home"), "go",
                                   timeout=60, private=(str(ROOT),))
        assert res["rc"] == 0, res["err"][-3000:]
        prefix, test_split = res["out"].strip().splitlines()[-1].rsplit(" ", 1)
        assert prefix == str(venv) and (root / "archive" / "new" / "cand_1.py").exists()
        if isolation.plan()["landlock_abi"]:
            assert test_split == "refused"  # the venv is granted, the rest of the repository is not
        shutil.rmtree(root)
    finally:
        if where == "repository":
            shutil.rmtree(venv, ignore_errors=True)


PROXY_CLIENT = r"""
'''A stand-in agent that goes out the only way there is: HTTPS_PROXY (127.0.0.1:443, the relay to the
parent's egress proxy), with CONNECT requests; prints {target: reply} as JSON.'''
import json, os, socket, sys
T = json.loads(sys.argv[1])
proxy = os.environ["HTTPS_PROXY"].rsplit("/", 1)[-1]
host, port = proxy.split(":")
out = {"proxy": os.environ["HTTPS_PROXY"]}
for request in T["requests"]:
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(request.encode() + b"\r\n\r\n")
            head = s.recv(4096).decode("latin-1")
            if head.startswith("HTTP/1.1 200"):
                s.sendall(b"ping")
                head += "|" + s.recv(10).decode()
            out[request] = head.split("\r\n")[0] + ("|" + head.split("|", 1)[1] if "|" in head else "") + \
                ("" if head.startswith("HTTP/1.1 200") else " " + head.split("\r\n\r\n", 1)[-1].strip())
    except OSError as e:
        out[request] = f"error {e}"
print(json.dumps(out))
"""


@pytest.mark.slow
def test_agent_jail_egress_only_through_the_proxy_to_allowed_hosts_on_443(tmp_path):
    """The agent's one way out: CONNECT through its relay to the parent's egress proxy, which lets
    through an allowed host on an allowed port and refuses any other host, port, plain HTTP and a
    host that resolves to a local address; the bytes of an allowed tunnel flow both ways. (A local
    server stands in for the API host: allow_local=True lets it through, as no CLI run does.)"""
    if not isolation.plan()["root"]:
        pytest.skip("the network namespace and the proxy need root")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def echo():
        for _ in range(2):
            c, _ = server.accept()
            c.sendall(b"pong:" + c.recv(4))
            c.close()
    threading.Thread(target=echo, daemon=True).start()
    script = tmp_path / "client.py"
    script.write_text(PROXY_CLIENT)
    asks = [f"CONNECT localhost:{port} HTTP/1.1", f"CONNECT evil.example:{port} HTTP/1.1",
            "CONNECT localhost:22 HTTP/1.1", f"GET http://localhost:{port}/ HTTP/1.1"]
    outs = {}
    try:
        for allow_local in (True, False):
            root = agent_cell(tmp_path)
            res = agent_jail.run_agent(f"{sys.executable} {script} {shlex.quote(json.dumps({'requests': asks}))}",
                                       str(root / "archive"), str(root / "home"), "", timeout=60,
                                       hosts=["localhost"], ports=[port], allow_local=allow_local)
            assert res["rc"] == 0, res["err"][-2000:]
            outs[allow_local] = (json.loads(res["out"].strip().splitlines()[-1]), res["network"])
            shutil.rmtree(root)
    finally:
        server.close()
    got, log = outs[True]
    assert got["proxy"] == "http://127.0.0.1:443"
    assert got[asks[0]] == "HTTP/1.1 200 Connection established|pong:ping"
    assert got[asks[1]] == "HTTP/1.1 403 Forbidden evil.example is not an allowed host (--proposer-hosts: localhost)"
    assert got[asks[2]] == f"HTTP/1.1 403 Forbidden port 22: only {port}"
    assert got[asks[3]].startswith("HTTP/1.1 403 Forbidden not a CONNECT request")
    assert [(e["host"], e["allowed"]) for e in log] == [("localhost", True), ("evil.example", False),
                                                        ("localhost", False), (None, False)]
    got, log = outs[False]  # as every real call runs: a host that resolves to this machine is refused
    assert got[asks[0]] == "HTTP/1.1 403 Forbidden localhost resolves to 127.0.0.1, not a public address"
    assert log[0]["allowed"] is False


BOUNDED_AGENTS = {
    # each leaves something huge or deep; the call still returns its one good candidate
    "300 MB on stdout": "sys.stdout.buffer.write(b'x' * (300 << 20))",
    "a 64 GB sparse file": "f = open('big.bin', 'wb')\ntry:\n    f.truncate(64 << 30)\nexcept OSError as e:\n"
                           "    print('refused', e, file=sys.stderr)\nf.truncate(900 << 20)",
    "a tree 1,500 directories deep": "here = os.getcwd()\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n"
                                     "os.chdir(here)",
    "5,000 files in new/": "for k in range(5000):\n    open(f'new/junk_{k}.txt', 'w').close()",
    "a fifo named like a candidate": "os.mkfifo('new/cand_2.py')",
}


@pytest.mark.slow
@pytest.mark.parametrize("leaves", list(BOUNDED_AGENTS))
def test_what_an_agent_leaves_is_read_with_bounds_and_costs_only_itself(tmp_path, leaves, monkeypatch):
    """stdout is kept to its first and last OUT_KEEP bytes (the rest counted), the copy is
    snapshotted with limits and removed whatever it holds (nothing left in /tmp), and the call's
    valid candidate comes back. (The fifo without Landlock, which refuses to make one.)"""
    if "fifo" in leaves:
        monkeypatch.setenv("WHALE_SANDBOX_NO_LANDLOCK", "1")
    d = tmp_path / "arch"
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, None, archive_dir=str(d),
                    should_stop=stop_after(1), log=quiet)
    good = hsrc.splice(H0, "QUALITY", "QUALITY = 0.3")
    agent = tmp_path / "agent.py"
    agent.write_text(f"import os, sys\nsys.stdin.read()\nopen('new/cand_1.py', 'w').write({good!r})\n"
                     + BOUNDED_AGENTS[leaves] + "\n")
    work_root = tmp_path / "cells"
    work_root.mkdir()
    prop = agent_proposer.command_proposer(DOMAIN, f"{sys.executable} {agent}", 120, 4000, workdir_root=str(work_root))
    proposal = prop(str(d), 2)
    assert [c["source"] for c in proposal.candidates] == [good], proposal.errors
    assert list(work_root.iterdir()) == []  # the copy is gone, whatever it held
    errors = " | ".join(proposal.errors)
    assert "could not be removed" not in errors and "failed (" not in errors, errors
    log = (d / "PROPOSE.log").stat().st_size
    assert log < 3 * agent_jail.OUT_KEEP
    if "stdout" in leaves:
        assert f"stdout: {300 << 20} bytes; kept the first and the last {agent_jail.OUT_KEEP}" in errors
    if "5,000" in leaves:
        assert "integrity: ignored new/: 5000 entries not named new/cand_N.py (junk_0.txt, junk_1.txt," in errors
    if "fifo" in leaves:
        assert "integrity: ignored new/cand_2.py: not a regular file" in errors
    if "deep" in leaves:
        assert "deeper than 32 levels; not looked into" in errors


def test_remove_tree_of_any_depth_and_what_it_cannot_remove(tmp_path):
    """agent_proposer.remove_tree: a tree deeper than Python's recursion limit and path limit goes
    without a RecursionError; links are removed, never followed."""
    top = tmp_path / "t"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for _ in range(3000):  # ~6,000 characters of path: no path-based call could reach the bottom
        os.mkdir("d", dir_fd=fd)
        new = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = new
    os.close(fd)
    keep = tmp_path / "keep.txt"
    keep.write_text("x")
    (top / "link").symlink_to(keep)
    assert agent_proposer.remove_tree(str(top)) == []
    assert not top.exists() and keep.read_text() == "x"


def test_snapshot_of_a_sparse_file_reads_what_it_allocates(tmp_path):
    """A sparse 64 GB file costs the snapshot SNAP_FILE_BYTES of reading, not 64 GB of memory; a
    change past those bytes still shows (size, blocks, mtime are in the digest)."""
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(64 << 30)
    before = agent_proposer.snapshot(str(tmp_path))
    assert before["big.bin"][1] == 64 << 30 and before["big.bin"][3] is None
    with open(big, "r+b") as f:
        f.seek(10 << 30)
        f.write(b"x")
    assert agent_proposer.changed_paths(before, agent_proposer.snapshot(str(tmp_path))) == [("big.bin", "changed")]


DEEP_SOURCES = {"a 90,000-deep attribute chain": "X = a" + ".b" * 90000 + "\n",
                "100,000 unary minus signs": "X = " + "-" * 100000 + "1\n",
                "200 nested lists": "X = " + "[" * 200 + "]" * 200 + "\n"}


@pytest.mark.parametrize("what", list(DEEP_SOURCES))
def test_a_candidate_too_deep_to_check_is_invalid_and_the_search_and_its_resume_go_on(tmp_path, what):
    """The static check runs under a bound (harness_source.parse): a source that makes the parser
    recurse or run out of memory is an invalid candidate with its reason; a valid candidate of the
    same call is evaluated; the archive holding it resumes."""
    d = str(tmp_path / "arch")
    deep = H0 + DEEP_SOURCES[what]
    good = hsrc.splice(H0, "QUALITY", "QUALITY = 0.3")

    def propose(archive_dir, k):
        return [dict(source=deep, proposer="fake", note="deep"), dict(source=good, proposer="fake", note="good")]
    mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, propose, archive_dir=d, k=2,
                    should_stop=stop_after(2), log=quiet)
    arch = harness_archive.load_archive(d)
    assert [c["name"] for c in arch] == ["cand_000", "cand_001", "cand_002"]
    assert "too deeply nested" in arch[1]["invalid"] or "nested deeper than" in arch[1]["invalid"]
    assert arch[2]["scores"] and not arch[2]["invalid"]
    res = mh.search_phase(H0, DOMAIN, EXAMPLES, make_evaluate(), ok_validate, propose, archive_dir=d, k=2,
                          should_stop=stop_after(3), log=quiet)  # the resume reads the archive that holds it
    assert res["incumbent_source"] in (H0, good)
    assert hsrc.normalized(deep).startswith("unparsable:") and hsrc.hypothesis(deep) is None


@pytest.mark.slow
def test_a_harness_too_deep_to_check_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "deep.py"
    bad.write_text(Path(searchqa.H0).read_text() + DEEP_SOURCES["a 90,000-deep attribute chain"])
    r = run_whale("--domain", "searchqa", "--method", "eval", "--harness", str(bad), "--out", str(tmp_path / "x"),
                  timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "too deeply nested" in r.stderr
    assert not (tmp_path / "x").exists()


KEEPALIVE_TOOL = '''
def run(task, llm, tools):
    code = """
import json, os, sys, time
for _ in range(200):   # 20 s of keep-alive frames: each one reset the tool's clock before issue 54
    body = json.dumps({"t": "hello"}).encode()
    os.write(int(sys.argv[3]), len(body).to_bytes(4, "big") + body)
    time.sleep(0.1)
"""
    return tools.python(code if task["q"] == "frames" else "while True:\\n    pass")
'''


@pytest.mark.slow
def test_a_tool_call_lives_inside_its_rollouts_deadline(tmp_path):
    """Math's python tool (sandbox.run_python) in a real rollout: code that sends keep-alive frames
    is a protocol violation at the second frame, and code that runs on stops at the rollout's
    deadline (2 s) rather than at the tool's own 5 s: the rollout is charged its time and ends."""
    jobs = [{"rid": 0, "task": {"q": "frames"}, "seed": 0}, {"rid": 1, "task": {"q": "loop"}, "seed": 0}]
    tools = lambda rid: {"python": lambda code: sandbox.run_python(code, timeout_s=5.0)}
    t0 = time.monotonic()
    recs = sandbox.run_rollouts(KEEPALIVE_TOOL, jobs, lambda calls: [], tools, rollout_timeout=2.0, concurrency=1)
    took = time.monotonic() - t0
    assert recs[0]["tool_calls"][0]["result"] is not None or recs[0]["tool_calls"][0]["error"] is None
    assert json.loads(recs[0]["tool_calls"][0]["result"])["error"] == "protocol violation: unexpected message"
    assert recs[1]["status"] == "timeout" and "rollout timeout" in recs[1]["error"], recs[1]
    assert json.loads(recs[1]["tool_calls"][0]["result"])["error"] == "TimeoutError: ran past its rollout's deadline"
    assert 1.9 < recs[1]["charged_s"] < 2.6 and took < 6, (recs[1]["charged_s"], took)


def test_agent_workspace_outcome_tables_failures_guide_and_hypotheses(tmp_path):
    """What the agent's copy adds to the archive: per-example outcome tables, failed traces grouped
    by failure kind, a guide; every candidate's docstring line is its hypothesis in summary.jsonl."""
    d = str(tmp_path / "arch")
    arch = archive_with_history(d)
    work = tmp_path / "work"
    work.mkdir()
    agent_proposer.write_workspace(d, str(work), DOMAIN)
    guide = (work / "GUIDE.md").read_text()
    assert guide.startswith("---\nname: ") and DOMAIN.SKILL in guide and "new/cand_1.py" in guide
    assert str(sandbox.MAX_PROMPT_CHARS) in guide and "paired sign" in guide
    c1, c0 = arch[1], arch[0]
    won, lost = archive_view.outcomes_vs(c1, c0)
    table = (work / "OUTCOMES.md").read_text()
    assert f"cand_001 | cand_000 | {c1['scores']['success']:.3f} | {c0['scores']['success']:.3f} | {len(won)} | 0 |" in table
    tsv = [x.split("\t") for x in (work / "outcomes.tsv").read_text().splitlines()]
    scored = [c for c in arch if c["scores"]]
    assert tsv[0] == ["example_id"] + [c["name"] for c in scored] and len(tsv) == 1 + len(EXAMPLES)
    assert [float(x) for x in tsv[1][1:]] == [c["scores"]["per_example"][0] for c in scored]
    fails = (work / "failures" / "cand_000.md").read_text()
    n_failed = sum(float(r["score"]) < 0.5 for r in harness_archive.read_traces(c0))
    assert f"failed rollouts by kind ({n_failed} of 40)" in fails
    for kind, n in primitives.failure_signatures(harness_archive.read_traces(c0)).items():
        assert f"## {kind}: {n} rollouts. {agent_proposer.FAILURE_KINDS[kind]}" in fails
    assert fails.count("### example") == 3  # a few traces per kind, not all of them
    summary = [json.loads(x) for x in open(os.path.join(d, "summary.jsonl"))]
    assert summary[0]["hypothesis"] == "Toy harness." and summary[-1]["hypothesis"] is None  # unparsable: none


def test_the_egress_proxys_log_stays_bounded_however_many_connections_come():
    """Issue 66: a flood of CONNECTs (allowed or refused) keeps MAX_LOG entries and one that counts the rest."""
    log = []
    for k in range(agent_jail.MAX_LOG + 500):
        agent_jail._note(log, dict(host=f"h{k}", port=443, allowed=False, why="not an allowed host"))
    assert len(log) == agent_jail.MAX_LOG + 1 and log[-1]["more"] == 500 and "500 more" in log[-1]["why"]
