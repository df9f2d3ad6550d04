"""agent_jail.py: run the command proposer's coding agent confined, and end it by its deadline.

    run_agent(command, cwd, home, prompt, timeout, env_names=(), private=(), hosts=DEFAULT_HOSTS)
        -> dict(out, err, rc, timed_out, notes, network, landlock, pid_ns, uid)

The agent (Claude Code's `claude -p`, Codex's `codex exec`, a test's stand-in) is untrusted
code that holds an API key. It runs through a small launcher (this file, run as a script) that
builds its cell, relays its network traffic and waits for it. What the cell holds it to:

| layer | what it stops | needs |
| --- | --- | --- |
| uid nobody, no groups, an empty capability bounding set, no_new_privs | reading root's files (/etc/shadow, /root), changing the host (network configuration, hostname, `chattr +i`), raw sockets, regaining a privilege through a setuid program | root |
| a PID namespace | everything it starts, `setsid` daemons too, dies with it or at the deadline; its /proc shows only its own processes (not the parent's environment) | root |
| a network namespace of its own | every service on this machine (TCP, UDP, abstract UNIX sockets); its only way out is 127.0.0.1:443, a relay to the parent's egress proxy | root |
| the egress proxy (in the parent) | any host but those of `--proposer-hosts`, any port but 443, any host that resolves to a private or local address; plain HTTP; the proxy resolves DNS itself | root |
| a mount namespace | covers /tmp, /var/tmp, /run and /dev/shm (path-based UNIX sockets of local services live there) and directories nobody may not enter (e.g. /root) with empty tmpfs, and binds back only the paths it is granted; its terminals are a devpts instance of its own, none of the host's | root |
| Landlock | files: READ the system (/usr, /bin, /lib*, /etc, /opt, /sys, its /proc, a few /dev files), its own installation (the directory of its executable and of its script interpreter; a bin/ with a lib/ beside it means the prefix above) and the files its command line names; READ and WRITE only `cwd` (its copy of the archive) and `home` (its HOME and TMPDIR); not the repository (its data/ holds the test split), WHALE_DATA, the run directory, your home, /tmp. TCP: connect to port 443 only, no bind (ABI >= 4); signals and abstract UNIX sockets only inside the cell (ABI >= 6) | Linux >= 5.13 |
| seccomp (isolation.seccomp_program) | sockets other than AF_UNIX and TCP (no UDP, raw, packet, netlink, MPTCP); TIOCSTI (typing into a terminal); new namespaces, mounts, io_uring, ptrace, bpf, keyrings, modules | x86_64 or aarch64 |
| a scrubbed environment | your other secrets: it gets PATH, LANG/LC_*, TERM, TZ, USER/LOGNAME, SHELL, HOME and TMPDIR in its own directory, the proxy's address, and exactly the variables you name (--proposer-env) | - |
| rlimits | a file over FSIZE_MB; core dumps | - |
| the deadline | at `timeout` the launcher's process group is killed, and with it PID 1 and so the namespace; the last read of its output waits at most GRACE_S more | - |
| bounded output | its stdout and stderr keep the first and last OUT_KEEP bytes; the rest is counted and reported | - |

Where a layer is missing the parent prints one warning line for it and runs the agent with what
is left: not root means no uid change, no namespaces, no proxy (Landlock's port rule and seccomp
are then its network layers: any host on port 443 is reachable, and UDP for its DNS); no Landlock in the kernel;
Landlock ABI < 4 (no port rule); an architecture without a seccomp table.
WHALE_SANDBOX_NO_LANDLOCK=1 turns Landlock off here too (tests use it to show the layers behind).

What it leaves out: file metadata (stat, readlink: a path's existence and size stay visible),
side channels, kernel exploits, CPU and memory limits (the deadline bounds time), the content of
what the allowed hosts are sent (the agent holds your key; it may send the archive, which holds
no test data, to them), and a non-root user's runs, which get only the layers marked "-" and
Landlock and seccomp. The copy of the archive and what the agent leaves there are read back
with limits by agent_proposer.py.
"""
import ipaddress
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading

if __name__ == "__main__":  # run as the launcher (python jail/agent_jail.py SPEC): import from the repository's root
    sys.path[0] = os.path.dirname(sys.path[0])
from jail import isolation
from jail import landlock
from jail.sandbox_child import under

GRACE_S = 5.0        # after the kill: how long the last read of the agent's output may take
TCP_PORTS = (443,)   # the only TCP port the agent may connect to (HTTPS; the relay listens there)
DEFAULT_HOSTS = ("api.anthropic.com", "api.openai.com")  # --proposer-hosts' default: Claude Code's and Codex's APIs
OUT_KEEP = 1 << 20   # bytes of stdout and of stderr kept from the start, and again from the end
FSIZE_MB = 1024      # the largest file the agent may write
KEEP_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "USER", "LOGNAME", "SHELL")
SYSTEM_READ = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/etc", "/opt", "/sys", "/proc")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
PTY_DEVICES = ("/dev/ptmx", "/dev/pts")  # granted only where they are the cell's own devpts (as root)
COVERED = ("/tmp", "/var/tmp", "/run", "/dev/shm")  # under empty tmpfs in the cell; granted paths bound back
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def agent_env(home, names=()):
    """The agent's environment: what a CLI needs to start, HOME/TMPDIR in its own directory, and
    the variables the user named (a named variable that is not set is left out). The launcher
    adds the proxy's address."""
    env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update(HOME=home, TMPDIR=home)
    env.update({k: os.environ[k] for k in names if k in os.environ})
    return env


def _install_dirs(path):
    """Where an executable lives, as its path names it and as that path resolves: each its directory,
    or the prefix above a bin/ that has a lib/ beside it. Both: a venv's bin/python3 is a link to the
    base interpreter, so the venv (its pyvenv.cfg, its site-packages) and the base are both needed;
    an npm CLI in ~/.npm-global/bin is a link into ~/.npm-global/lib/node_modules."""
    out = []
    for p in (os.path.abspath(path), os.path.realpath(path)):
        d = os.path.dirname(p)
        parent = os.path.dirname(d)
        out.append(parent if os.path.basename(d) == "bin" and os.path.isdir(os.path.join(parent, "lib")) else d)
    return out


def _interpreter(path):
    """The program a script's #! line names, or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n")[0].decode("utf-8", "replace").split()
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        return shutil.which(words[1])
    return words[0] if words else None


def _grant_around(path, rights, private):
    """[(path, rights)] granting `path` except anything in `private` beneath it."""
    path = os.path.realpath(path)
    inside = [p for p in private if under(p, path)]
    if not inside:
        return [(path, rights)]
    if path in inside or not os.path.isdir(path):
        return []
    out = []
    for name in sorted(os.listdir(path)):
        out += _grant_around(os.path.join(path, name), rights, private)
    return out


def program_paths(command, env):
    """What the agent's command line needs to read: its program's installation, its script
    interpreter's, and the files it names (`python agent.py`: the script)."""
    words = shlex.split(command) if command.strip() else []
    exe = shutil.which(words[0], path=env.get("PATH")) if words else None
    programs = [p for p in [exe, exe and _interpreter(exe)] if p]
    return list(dict.fromkeys([d for p in programs for d in _install_dirs(p)] +
                              [os.path.realpath(w) for w in words[1:] if os.path.isfile(w)]))


def jail_rules(command, env, private, pty=False):
    """The Landlock (path, rights) list of the agent, besides its own directories."""
    ro = landlock.FS_READ_FILE | landlock.FS_READ_DIR | landlock.FS_EXECUTE
    private = [os.path.realpath(p) for p in private if p]
    grants = [d for d in SYSTEM_READ if os.path.exists(d)] + program_paths(command, env)
    rules = []
    for g in dict.fromkeys(grants):
        rules += _grant_around(g, ro, private)
    rw = landlock.FS_READ_FILE | landlock.FS_WRITE_FILE | landlock.FS_TRUNCATE | landlock.FS_IOCTL_DEV
    devices = DEVICES + (PTY_DEVICES if pty else ())
    return rules + [(d, rw | landlock.FS_READ_DIR) for d in devices if os.path.exists(d)]


def cell_mounts(binds):
    """(covers, binds): the directories to cover with empty tmpfs in the cell, and which of the
    granted paths in `binds` ([(path, writable)]) must be bound back beneath them: COVERED, and
    any directory on the way to a granted path that nobody may not enter (e.g. /root, mode 700)."""
    covers = {d for d in COVERED if os.path.isdir(d) and not os.path.islink(d)}
    for path, _ in binds:
        hidden = isolation.unsearchable_ancestor(path)
        if hidden and hidden != "/" and not any(hidden in (s, os.path.dirname(s)) for s in SYSTEM_READ):
            covers.add(hidden)
    covers = sorted(d for d in covers if not any(c != d and under(d, c) for c in covers))
    back = [(p, w) for p, w in binds if any(under(p, c) for c in covers)]
    back = [(p, w) for p, w in back if not any(q != p and under(p, q) for q, _ in back)]  # outermost only
    return covers, sorted(back)


# -----------------------------------------------------------------------------
# The egress proxy (in the parent, outside the cell) and its relay (in the launcher, inside the
# cell's network namespace, on 127.0.0.1:443)

def host_allowed(host, hosts):
    """`host` is one of `hosts`, or under a "*.domain" entry of them."""
    host = host.lower().rstrip(".")
    return any(host == h or (h.startswith("*.") and host.endswith(h[1:])) for h in (x.lower() for x in hosts))


def _pump(a, b, idle_s=300.0):
    """Copy bytes both ways between sockets a and b until one side closes (or idle_s of silence).
    Returns the bytes copied. (poll, not select: any descriptor number works.)"""
    n, by_fd = 0, {a.fileno(): a, b.fileno(): b}
    poller = select.poll()
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    try:
        while True:
            ready = poller.poll(idle_s * 1000)
            if not ready:
                return n
            for fd, _ in ready:
                s = by_fd[fd]
                data = s.recv(1 << 16)
                if not data:
                    return n
                (b if s is a else a).sendall(data)
                n += len(data)
    except OSError:
        return n


def _read_head(conn, limit=8192):
    """The request head (up to the blank line), at most `limit` bytes, or None."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = conn.recv(1024)
        if not data or len(head) + len(data) > limit:
            return None
        head += data
    return head


def _proxy_one(conn, hosts, ports, allow_local, log):
    """One client of the egress proxy: `CONNECT host:port`, checked, then a byte pipe."""
    upstream = None
    try:
        conn.settimeout(30)
        head = _read_head(conn)
        line = head.split(b"\r\n")[0].decode("latin-1") if head else ""
        m = re.fullmatch(r"CONNECT (\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5}) HTTP/1\.[01]", line)
        host, port, why, addr = None, None, None, None
        if not m:
            why = f"not a CONNECT request ({line[:60]!r}): only HTTPS through CONNECT goes out"
        else:
            host, port = m.group(1).strip("[]").lower(), int(m.group(2))
            if port not in ports:
                why = f"port {port}: only {', '.join(map(str, ports))}"
            elif not host_allowed(host, hosts):
                why = f"{host} is not an allowed host (--proposer-hosts: {','.join(hosts) or 'none'})"
            else:
                try:  # the proxy resolves: the agent's cell has no DNS
                    addrs = [i[4][0] for i in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
                except OSError as e:
                    addrs, why = [], f"{host} does not resolve ({e})"
                local = [a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_global]
                if local and not allow_local:  # checked and connected on the same address (no rebinding)
                    why = f"{host} resolves to {local[0]}, not a public address"
                addr = addrs[0] if addrs else None
        if why is None:
            try:
                upstream = socket.create_connection((addr, port), timeout=15)
            except OSError as e:
                why = f"could not connect to {host}:{port} ({e.strerror or e})"
        if why is not None:
            _note(log, dict(host=host, port=port, allowed=False, why=why))
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
                         + why.encode() + b"\n")
            return
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        conn.settimeout(None)
        upstream.settimeout(None)
        entry = dict(host=host, port=port, allowed=True, bytes=0)
        _note(log, entry)
        entry["bytes"] = _pump(conn, upstream)
    except OSError:
        pass
    finally:
        for s in (conn, upstream):
            if s is not None:
                s.close()


MAX_LOG = 1000          # CONNECTs the proxy's log lists; past them one line says how many more came
MAX_CONNECTIONS = 64    # connections the proxy serves at once; more are closed at once


_LOG_LOCK = threading.Lock()


def _note(log, entry):
    """Append entry to the proxy's log, which stays at MAX_LOG entries plus one counting the rest."""
    with _LOG_LOCK:
        if len(log) < MAX_LOG:
            log.append(entry)
        elif len(log) == MAX_LOG:
            log.append(dict(host=None, port=None, allowed=False, why="log full: 1 more connection not listed", more=1))
        else:
            log[-1]["more"] += 1
            log[-1]["why"] = f"log full: {log[-1]['more']} more connections not listed"


def start_egress(path, hosts, ports=TCP_PORTS, allow_local=False):
    """Serve the egress proxy on the UNIX socket `path` in threads of this process. Returns
    (log, stop): log is a list that gets one dict per CONNECT (host, port, allowed, why or bytes).
    allow_local lets a host resolve to a local address (a test's local server; never the CLI's)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)  # the launcher (root) connects; nobody else
    server.listen(64)
    log, stopping, slots = [], threading.Event(), threading.BoundedSemaphore(MAX_CONNECTIONS)

    def one(conn):
        try:
            _proxy_one(conn, tuple(hosts), tuple(ports), allow_local, log)
        finally:
            slots.release()

    def serve():
        while not stopping.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            if not slots.acquire(blocking=False):  # a flood of connections: no thread, no log line each
                conn.close()
                continue
            threading.Thread(target=one, args=(conn,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()

    def stop():
        stopping.set()
        try:
            server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        server.close()
    return log, stop


def _relay(listener, path):
    """In the launcher (inside the cell's network namespace): each connection to 127.0.0.1:443
    is piped to the parent's egress proxy at the UNIX socket `path`."""
    def one(conn):
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(path)
            _pump(conn, up)
        except OSError:
            pass
        finally:
            conn.close()
            up.close()
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=one, args=(conn,), daemon=True).start()


# -----------------------------------------------------------------------------
# The parent side: run the launcher, read its output with bounds, end it by the deadline

def _read_bounded(pipe, keep, out):
    """Read `pipe` to its end, keeping the first and the last `keep` bytes; out gets
    head, tail and the total count."""
    head, tail, total = bytearray(), bytearray(), 0
    try:
        while True:
            data = pipe.read1(1 << 16)
            if not data:
                break
            total += len(data)
            room = keep - len(head)
            if room > 0:
                head += data[:room]
                data = data[room:]
            if data:
                tail += data
                del tail[:max(0, len(tail) - keep)]
    except (OSError, ValueError):
        pass
    out.update(head=bytes(head), tail=bytes(tail), total=total)


def _text(got, what, notes):
    if not got:
        return ""
    kept = len(got["head"]) + len(got["tail"])
    text = (got["head"] + (b"" if kept == got["total"] else
                           f"\n[... {got['total'] - kept} bytes of {what} left out ...]\n".encode()) + got["tail"])
    if kept < got["total"]:
        notes.append(f"{what}: {got['total']} bytes; kept the first and the last {OUT_KEEP} "
                     f"({got['total'] - kept} left out)")
    return text.decode("utf-8", "replace")


def _chown_tree(top, uid):
    """chown -R top to uid (iteratively: a deep tree is no recursion)."""
    stack = [top]
    while stack:
        d = stack.pop()
        os.lchown(d, uid, uid)
        with os.scandir(d) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    os.lchown(e.path, uid, uid)


def run_agent(command, cwd, home, prompt, timeout, env_names=(), private=(), hosts=DEFAULT_HOSTS,
              ports=TCP_PORTS, allow_local=False):
    """Run `command` (a shell line) in `cwd` with the prompt on stdin, confined as the module
    docstring says; never longer than timeout + GRACE_S. Returns dict(out, err, rc, timed_out,
    notes, network, landlock, pid_ns, uid): notes = what went wrong around the agent (output cut
    or abandoned); network = the egress proxy's log (one dict per CONNECT); landlock = the ABI
    the jail used (0: none); pid_ns = whether it had its own namespaces; uid = its uid."""
    import tempfile
    plan = isolation.plan()
    root = plan["root"]
    env = agent_env(home, env_names)
    abi = isolation.landlock_abi(plan)
    if not abi:
        isolation.warn_once("agent_jail", f"{plan['landlock_off'] or 'WHALE_SANDBOX_NO_LANDLOCK is set'}: the "
                            "proposer's agent runs without its Landlock jail (it can read and write what its user can)")
    elif abi < 4:
        isolation.warn_once("agent_jail", f"Landlock ABI {abi} < 4: the proposer's agent may connect to any TCP port")
    if not root:
        isolation.warn_once("agent_jail", "not root: the proposer's agent runs as you, without its namespaces and "
                            "egress proxy (a daemon it starts may outlive the call; any host on port 443 is reachable)")
    program = isolation.seccomp_program(udp=not root)  # (without its proxy it resolves DNS itself)
    if program is None:
        isolation.warn_once("agent_jail", f"no seccomp table for {os.uname().machine}: the proposer's agent may open "
                            "any socket its user may")
    cwd, home = os.path.realpath(cwd), os.path.realpath(home)
    egress_dir = tempfile.mkdtemp(prefix="whale-egress-") if root else None
    log, stop = start_egress(os.path.join(egress_dir, "proxy.sock"), hosts, ports, allow_local) if root else ([], None)
    if root:
        for d in (cwd, home):
            _chown_tree(d, isolation.NOBODY)
    covers, binds = cell_mounts([(p, False) for p in program_paths(command, env)] + [(cwd, True), (home, True)]) \
        if root else ([], [])
    spec = dict(command=command, root=root, landlock=abi, ports=list(TCP_PORTS), cwd=cwd,
                rules=jail_rules(command, env, private, pty=root) if abi else [], writable=[cwd, home],
                covers=covers, binds=binds, seccomp=program.hex() if program else None,
                egress=egress_dir and os.path.join(egress_dir, "proxy.sock"), fsize=FSIZE_MB << 20,
                last_cap=int(open("/proc/sys/kernel/cap_last_cap").read()) if root else 0)
    argv = [plan["exe"], "-s", "-B", os.path.realpath(__file__), json.dumps(spec)]
    notes, timed_out, got = [], False, ({}, {})
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=lambda: plan["libc"].prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL, 0,
                                                                      0, 0))
        readers = [threading.Thread(target=_read_bounded, args=(p, OUT_KEEP, g), daemon=True)
                   for p, g in ((proc.stdout, got[0]), (proc.stderr, got[1]))]

        def feed():
            try:
                proc.stdin.write(prompt.encode("utf-8", "replace"))
                proc.stdin.close()
            except OSError:  # it exited, or never reads stdin
                pass
        for t in readers + [threading.Thread(target=feed, daemon=True)]:
            t.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and PID 1: the namespace goes with them
            except OSError:
                pass
            proc.wait()
        for t in readers:
            t.join(GRACE_S)
        if any(t.is_alive() for t in readers):  # a process outside the kill still holds the pipes
            notes.append("a process the agent started still held its output after the kill; output abandoned")
            got = ({}, {})
    finally:
        if stop:
            stop()
            shutil.rmtree(egress_dir, ignore_errors=True)
    return dict(out=_text(got[0], "stdout", notes), err=_text(got[1], "stderr", notes), rc=proc.returncode,
                timed_out=timed_out, notes=notes, network=list(log), landlock=abi, pid_ns=root,
                uid=isolation.NOBODY if root else os.getuid())


# -----------------------------------------------------------------------------
# The launcher (this file run as a script, outside the jail): build the cell, run the agent, wait.

def _mount(libc, get_errno, src, dst, fstype, flags, data=None):
    enc = lambda x: x.encode() if isinstance(x, str) else x
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        e = get_errno()
        raise OSError(e, f"mount {dst}: {os.strerror(e)}")


def _loopback_up():
    """Bring up `lo` in this (new) network namespace: SIOCSIFFLAGS with IFF_UP | IFF_LOOPBACK | IFF_RUNNING."""
    import fcntl, struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", 0x1 | 0x8 | 0x40))


def _build_cell(spec, p):
    """In PID 1 of the cell, as root, before exec: its mounts, Landlock, nobody, seccomp, rlimits."""
    import resource
    libc, err = p["libc"], p["get_errno"]
    if spec["root"]:
        if libc.unshare(isolation.CLONE_NEWNS) != 0:
            raise OSError(err(), "unshare(CLONE_NEWNS)")
        _mount(libc, err, None, "/", None, isolation.MS_REC | isolation.MS_PRIVATE)  # nothing leaks to the host
        quiet = isolation.MS_NOSUID | isolation.MS_NODEV | isolation.MS_NOEXEC
        _mount(libc, err, "proc", "/proc", "proc", quiet)  # this PID namespace's processes only
        # terminals: a devpts instance of its own (none of the host's ptys), its ptmx over /dev/ptmx
        _mount(libc, err, "devpts", "/dev/pts", "devpts", isolation.MS_NOSUID | isolation.MS_NOEXEC,
               "newinstance,ptmxmode=0666,mode=0620")
        _mount(libc, err, "/dev/pts/ptmx", "/dev/ptmx", None, isolation.MS_BIND)
        keep = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path, _ in spec["binds"]}
        for d in spec["covers"]:
            _mount(libc, err, "tmpfs", d, "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV,
                   "size=1m,nr_inodes=1024,mode=755")
        for path, writable in spec["binds"]:  # granted paths beneath a cover, bound back in place
            fd = keep[path]
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "a").close()
            _mount(libc, err, f"/proc/self/fd/{fd}", path, None, isolation.MS_BIND | isolation.MS_REC)
            if not writable:
                _mount(libc, err, None, path, None, isolation.MS_REMOUNT | isolation.MS_BIND | isolation.MS_RDONLY)
            os.close(fd)
    if spec["landlock"]:  # after the mounts (it forbids new ones), before nobody (opening may need root)
        landlock.restrict(libc, err, spec["landlock"], [tuple(r) for r in spec["rules"]], spec["writable"],
                          spec["ports"])
    if spec["root"]:
        isolation.drop_root(libc, err, spec["last_cap"])
    libc.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # again: a uid change clears it
    if spec["seccomp"]:
        isolation.install_seccomp(libc, err, bytes.fromhex(spec["seccomp"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize"], spec["fsize"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.chdir(spec["cwd"])  # through the cell's mounts


def _launch(spec):
    p = isolation.plan()
    libc = p["libc"]
    # Its network first (loopback only, and on it the relay to the egress proxy, a process of its
    # own, forked before the PID namespace so that it is outside it), then its PID namespace.
    ns = spec["root"] and libc.unshare(isolation.CLONE_NEWNET | 0x04000000 | 0x08000000) == 0  # + NEWUTS, NEWIPC
    env = dict(os.environ)
    relay = None
    if ns:  # the relay: forked before the PID namespace exists, so it is not in it (the agent never sees it)
        _loopback_up()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", TCP_PORTS[0]))
        listener.listen(64)
        relay = os.fork()
        if relay == 0:
            libc.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _relay(listener, spec["egress"])
            os._exit(0)
        listener.close()
        env.update({k: f"http://127.0.0.1:{TCP_PORTS[0]}" for k in PROXY_VARS})
        for k in ("NO_PROXY", "no_proxy"):
            env.pop(k, None)
    ns = ns and libc.unshare(isolation.CLONE_NEWPID) == 0  # the next child is its PID 1
    if spec["root"] and not ns:  # no mounts (they would be the host's), so no way for nobody to its files:
        print(f"agent_jail: WARNING: no namespaces ({os.strerror(p['get_errno']())}): the agent runs as root, "
              "with the host's network and mounts", file=sys.stderr, flush=True)
        spec["root"] = False  # it stays root, and the host's terminals are not granted
        spec["rules"] = [r for r in spec["rules"] if not any(under(r[0], d) for d in PTY_DEVICES)]
    pid = os.fork()
    if pid == 0:  # PID 1 of the new namespace (or a plain child without one)
        try:
            libc.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher killed: PID 1 dies
            _build_cell(spec, p)
            os.execve("/bin/sh", ["sh", "-c", spec["command"]], env)
        except BaseException as e:
            print(f"agent_jail: could not start the agent: {e}", file=sys.stderr, flush=True)
        os._exit(127)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if relay:
        os.kill(relay, signal.SIGKILL)
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]))
