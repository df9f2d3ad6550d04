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

from jail.sandbox_child import under

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
        from jail import landlock  # parent only (the child cannot read the repository)
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
            repo=os.path.dirname(os.path.dirname(os.path.realpath(__file__))),  # the repository's root
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
        from jail import landlock  # (loaded by plan() in the parent: no file access here)
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


# -----------------------------------------------------------------------------
# seccomp: the system calls a jailed process may make (the agent jail's filter)
#
# A classic-BPF program the kernel runs on every system call of the process and of everything
# it execs (it cannot be removed; installing it needs no_new_privs). It answers from the call's
# number and its first arguments, never from memory they point to. What this filter refuses:
# - sockets other than AF_UNIX and plain TCP over IPv4/IPv6 (protocol 0 or 6): no raw, packet,
#   netlink, UDP (unless asked: a jail without a proxy needs DNS), MPTCP, SCTP ... sockets (socketpair: AF_UNIX only); io_uring (its SOCKET op
#   would go round this filter);
# - the terminal injections TIOCSTI and TIOCLINUX (a command typed into someone's terminal);
# - new namespaces (unshare, setns, clone with CLONE_NEW*; clone3 says ENOSYS, its flags are
#   behind a pointer, and libc then falls back to clone), mounts, pivot_root, chroot;
# - the kernel's administrative surface: modules, kexec, bpf, perf, keyrings, userfaultfd,
#   open_by_handle_at, ptrace, hostname, clock, swap, reboot, ioperm/iopl;
# - system calls of another architecture (a 32-bit call on x86_64): the process is killed.
# Everything else is allowed: the rest of the jail (uid nobody, no capabilities, Landlock, the
# namespaces) decides what those calls reach.

SECCOMP_SET_MODE_FILTER_PRCTL, SECCOMP_MODE_FILTER = 22, 2  # prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCK_STREAM, SOCK_DGRAM, SOCK_TYPE_MASK, IPPROTO_TCP, IPPROTO_UDP = 1, 2, 0xF, 6, 17
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
CLONE_NEW_ANY = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (and NEWTIME's bit 7: below)
CLONE_NEWTIME = 0x80
EPERM, ENOSYS = 1, 38
# audit arch, and the numbers of the calls the filter names, per architecture
SYSCALLS = {
    "x86_64": dict(arch=0xC000003E, x32=0x40000000, socket=41, socketpair=53, ioctl=16, clone=56, clone3=435,
                   deny=dict(unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161,
                             init_module=175, finit_module=313, delete_module=176, kexec_load=246,
                             kexec_file_load=320, bpf=321, perf_event_open=298, keyctl=250, add_key=248,
                             request_key=249, userfaultfd=323, open_by_handle_at=304, ptrace=101,
                             sethostname=170, setdomainname=171, settimeofday=164, clock_settime=227,
                             adjtimex=159, swapon=167, swapoff=168, reboot=169, acct=163, ioperm=173, iopl=172,
                             io_uring_setup=425, io_uring_enter=426, io_uring_register=427, fsopen=430,
                             fsmount=432, move_mount=429, open_tree=428, mount_setattr=442, vhangup=153)),
    "aarch64": dict(arch=0xC00000B7, x32=None, socket=198, socketpair=199, ioctl=29, clone=220, clone3=435,
                    deny=dict(unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51,
                              init_module=105, finit_module=273, delete_module=106, kexec_load=104,
                              kexec_file_load=294, bpf=280, perf_event_open=241, keyctl=219, add_key=217,
                              request_key=218, userfaultfd=282, open_by_handle_at=265, ptrace=117,
                              sethostname=161, setdomainname=162, settimeofday=170, clock_settime=112,
                              adjtimex=171, swapon=224, swapoff=225, reboot=142, acct=89, io_uring_setup=425,
                              io_uring_enter=426, io_uring_register=427, fsopen=430, fsmount=432, move_mount=429,
                              open_tree=428, mount_setattr=442, vhangup=58)),
}


def seccomp_program(machine=None, udp=False):
    """The agent's filter as bytes (struct sock_filter[]), or None on an architecture without a
    table above. udp: also allow UDP sockets (a jail without its own network namespace and proxy,
    where the agent resolves DNS itself). A tiny assembler: ("ld", offset), ("jeq" | "jset" | "jge", k, label_true,
    label_false or None = next), ("and", k), ("ret", k), and labels as plain strings."""
    import platform, struct
    t = SYSCALLS.get(machine or platform.machine())
    if t is None:
        return None
    arg = lambda i: 16 + 8 * i  # struct seccomp_data: nr, arch, ip, args[6] (the low 32 bits, little-endian)
    errno = lambda e: RET_ERRNO | e
    prog = [("ld", 4), ("jeq", t["arch"], None, "kill"), ("ld", 0)]
    if t["x32"]:
        prog.append(("jge", t["x32"], "eperm", None))
    prog += [("jeq", nr, "eperm", None) for nr in t["deny"].values()]
    prog += [("jeq", t["clone3"], "enosys", None), ("jeq", t["socket"], "socket", None),
             ("jeq", t["socketpair"], "socketpair", None), ("jeq", t["ioctl"], "ioctl", None),
             ("jeq", t["clone"], "clone", None), ("ret", RET_ALLOW),
             "socket", ("ld", arg(0)), ("jeq", AF_UNIX, "allow", None), ("jeq", AF_INET, "inet", None),
             ("jeq", AF_INET6, "inet", "eperm"),
             "inet", ("ld", arg(1)), ("and", SOCK_TYPE_MASK), ("jeq", SOCK_DGRAM, "dgram", None),
             ("jeq", SOCK_STREAM, None, "eperm"),
             ("ld", arg(2)), ("jeq", 0, "allow", None), ("jeq", IPPROTO_TCP, "allow", "eperm"),
             "dgram", ("ld", arg(2)), ("jeq", 0, "udp", None), ("jeq", IPPROTO_UDP, "udp", "eperm"),
             "udp", ("ret", RET_ALLOW if udp else errno(EPERM)),
             "socketpair", ("ld", arg(0)), ("jeq", AF_UNIX, "allow", "eperm"),
             "ioctl", ("ld", arg(1)), ("jeq", TIOCSTI, "eperm", None), ("jeq", TIOCLINUX, "eperm", "allow"),
             "clone", ("ld", arg(0)), ("jset", CLONE_NEW_ANY | CLONE_NEWTIME, "eperm", "allow"),
             "allow", ("ret", RET_ALLOW), "eperm", ("ret", errno(EPERM)), "enosys", ("ret", errno(ENOSYS)),
             "kill", ("ret", RET_KILL_PROCESS)]
    at, n = {}, 0
    for op in prog:  # pass 1: where each label is
        if isinstance(op, str):
            at[op] = n
        else:
            n += 1
    out, pc = [], 0
    for op in prog:  # pass 2: encode; a jump's offsets count from the next instruction
        if isinstance(op, str):
            continue
        pc += 1
        if op[0] == "ld":
            out.append(struct.pack("=HBBI", 0x20, 0, 0, op[1]))  # BPF_LD | BPF_W | BPF_ABS
        elif op[0] == "and":
            out.append(struct.pack("=HBBI", 0x54, 0, 0, op[1]))  # BPF_ALU | BPF_AND | BPF_K
        elif op[0] == "ret":
            out.append(struct.pack("=HBBI", 0x06, 0, 0, op[1]))  # BPF_RET | BPF_K
        else:
            code = {"jeq": 0x15, "jge": 0x35, "jset": 0x45}[op[0]]  # BPF_JMP | BPF_K | JEQ/JGE/JSET
            jt, jf = (0 if lab is None else at[lab] - pc for lab in op[2:4])
            assert 0 <= jt < 256 and 0 <= jf < 256, op
            out.append(struct.pack("=HBBI", code, jt, jf, op[1]))
    return b"".join(out)


def install_seccomp(libc, get_errno, program):
    """Install `program` (seccomp_program's bytes) on this process for good; no_new_privs first
    (the kernel requires it of a process without CAP_SYS_ADMIN). Raises OSError."""
    import ctypes  # (loaded by plan(): no file access)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
    prog = Fprog(len(program) // 8, program)
    for args, what in (((38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)"),
                       ((SECCOMP_SET_MODE_FILTER_PRCTL, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0),
                        "prctl(PR_SET_SECCOMP)")):
        if libc.prctl(*[ctypes.c_ulong(a) for a in args]) != 0:
            e = get_errno()
            raise OSError(e, f"{what}: {os.strerror(e)}")


def drop_root(libc, get_errno, last_cap):
    """As root: empty the capability bounding set (so no exec can regain a capability), then
    become nobody with no groups; setuid from 0 clears the permitted and effective sets.
    Raises OSError if any step fails."""
    for cap in range(last_cap + 1):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            e = get_errno()
            raise OSError(e, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(e)}")
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
