"""
isolation.py: what this machine lets a jail do, and the lock-down a forked child applies to
itself before exec. The kernel mechanics shared by the two jails: sandbox.py (the harness
child: every layer) and agent_jail.py (the proposer's coding agent: a PID namespace and
Landlock with its own rules).

    plan() -> dict           # once per process: libc, the interpreter, root or not, Landlock's ABI
    landlock_abi(plan)       # the ABI to apply (0 when WHALE_SANDBOX_NO_LANDLOCK=1)
    covers(plan, scratch)    # the directories to hide under empty tmpfs from the harness child
    preexec(p)               # the harness child's steps between fork and exec
    warn_once(who, msg)      # a missing layer is one stderr line, once

The harness child's steps, in order (why each, and what the whole leaves out, is sandbox.py's
docstring): as root, new mount and network namespaces with tmpfs over `covers` and a tmpfs
scratch (as a normal user, a user+network namespace where the kernel allows it); Landlock
(after the mounts, which it would forbid, and before the uid drop, since opening the allowed
paths may need root); uid/gid nobody where nobody can reach the interpreter; PR_SET_PDEATHSIG;
rlimits last. Every step that needs a privilege the process lacks degrades instead of failing,
and the caller says so with warn_once. Linux only (ctypes to libc: mount, unshare, prctl).
"""
import os
import resource
import signal
import stat
import sys

from sandbox_child import under

NOBODY = 65534
SCRATCH_MB = 64              # tmpfs scratch size (when mount namespaces are available)

PLAN = {}  # what isolation this machine allows, filled on first use


def unsearchable_ancestor(path):
    """First directory on the way to path that 'nobody' cannot enter (e.g. /root, mode 700)."""
    parts = path.split("/")
    for k in range(2, len(parts)):
        d = "/".join(parts[:k])
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return d
        except OSError:
            return d
    return None


def plan():
    """What this machine allows, found once per process (libc, the interpreter and the
    directory holding it and the stdlib, root or not, Landlock's ABI and its rules for the
    interpreter). Callers may change it: namespaces turn off for good once mounting fails."""
    if not PLAN:
        import ctypes  # parent only
        import landlock  # parent only (the child cannot read the repository)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                               ctypes.c_char_p]
        libc.syscall.restype = ctypes.c_long
        exe = os.path.realpath(sys.executable)
        stdlib = os.path.realpath(os.path.dirname(os.__file__))
        abi, why = landlock.version(libc, ctypes.get_errno)
        PLAN.update(
            libc=libc, get_errno=ctypes.get_errno, exe=exe,
            base=os.path.commonpath([exe, stdlib]),  # holds the interpreter, libpython, stdlib
            hidden=unsearchable_ancestor(exe) or unsearchable_ancestor(stdlib),
            root=os.geteuid() == 0,
            namespaces=os.geteuid() == 0,  # set to False if mounting fails once
            repo=os.path.dirname(os.path.realpath(__file__)),
            landlock_abi=abi, landlock_off=why, landlock_rules=landlock.interpreter_rules(exe, stdlib))
    return PLAN


# Linux constants (not exposed by the stdlib)
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x20000000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/proc", "/dev", "/sys",
               "/tmp", "/var", "/run")
_WARNED = set()


def warn_once(who, msg):
    """One line on stderr, once per process and message: a weaker jail is never silent, nor noisy."""
    if msg not in _WARNED:
        _WARNED.add(msg)
        print(f"{who}: WARNING: {msg}", file=sys.stderr, flush=True)


def landlock_abi(p):
    """The Landlock ABI a jail applies: the kernel's, or 0 with WHALE_SANDBOX_NO_LANDLOCK=1 (tests
    set it to show what the layers behind Landlock stop on their own)."""
    return 0 if os.environ.get("WHALE_SANDBOX_NO_LANDLOCK") else p["landlock_abi"]


def covers(p, scratch):
    """The directories the harness child must not see, to cover with empty tmpfs (as root with
    namespaces): the repository (its data/ holds the test split), the parent's cwd, a parent of
    the interpreter that nobody cannot enter; never a system directory, nor one that holds a
    system directory or scratch, and no directory inside another one in the list."""
    found = {d for d in (p["repo"], os.path.realpath(os.getcwd()), p["hidden"])
             if d and d != "/" and not any(under(s, d) for s in SYSTEM_DIRS) and not under(scratch, d)}
    return sorted(d for d in found if not any(c != d and under(d, c) for c in found))


def mounts(p):
    """In a fresh mount namespace (as root, before exec): cover secret directories with empty
    tmpfs, re-bind the interpreter read-only if it was under one, give scratch its own tmpfs."""
    libc = p["libc"]

    def mount(src, dst, fstype, flags, data=None):
        if libc.mount(src, dst.encode() if isinstance(dst, str) else dst, fstype, flags, data) != 0:
            e = p["get_errno"]()
            raise OSError(e, f"mount {dst}: {os.strerror(e)}")

    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks back to the host
    rebind = any(under(p["base"], d) for d in p["covers"])
    fd = os.open(p["base"], os.O_PATH) if rebind else None
    for d in p["covers"]:
        mount(b"tmpfs", d, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,nr_inodes=256,mode=755")
    if fd is not None:
        os.makedirs(p["base"], exist_ok=True)
        mount(f"/proc/self/fd/{fd}".encode(), p["base"], None, MS_BIND | MS_REC)
        mount(None, p["base"], None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        os.close(fd)
    os.makedirs(p["scratch"], exist_ok=True)
    mount(b"tmpfs", p["scratch"], b"tmpfs", MS_NOSUID | MS_NODEV,
          f"size={SCRATCH_MB}m,nr_inodes=4096,mode=700,uid={NOBODY},gid={NOBODY}".encode())
    os.chdir(p["scratch"])  # Popen chdir'ed before the mount, into the directory now covered


def preexec(p):
    """The harness child's lock-down, in the forked child just before exec (so still our own
    trusted code): p is plan() plus limits, covers, scratch, ppid and landlock_abi."""
    libc = p["libc"]
    os.umask(0o022)
    namespaces = False
    if p["root"] and p["namespaces"]:
        namespaces = libc.unshare(CLONE_NEWNS | CLONE_NEWNET) == 0
        if namespaces:
            mounts(p)  # an error here fails the spawn; the parent retries without namespaces
    elif not p["root"]:
        libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)  # best effort: no network; EPERM is fine
    # The kernel's file view, in every mode: after the mounts (it forbids new ones), before the
    # uid drop (opening the allowed paths may need root, e.g. under /root). It survives exec.
    if p["landlock_abi"]:
        import landlock  # (loaded by plan() in the parent: no file access here)
        landlock.restrict(p["libc"], p["get_errno"], p["landlock_abi"], p["landlock_rules"], [p["scratch"]])
    # Root ignores RLIMIT_NPROC and file permissions: become nobody. Without namespaces that
    # only works when nobody can reach the interpreter; otherwise we stay root (Landlock, the
    # hook and the rlimits but RLIMIT_NPROC still hold).
    if p["root"] and (namespaces or not p["hidden"]):
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
    if os.getppid() != p["ppid"]:  # the parent died before prctl
        os._exit(1)
    # Limits last: this forked copy of the parent may already be over RLIMIT_AS (exec resets it).
    for res, lim in p["limits"]:
        resource.setrlimit(res, (lim, lim))
