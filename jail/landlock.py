"""landlock.py: the kernel's view of files and TCP ports for one process (Linux Landlock).

    version(libc, get_errno) -> (abi, why_not)          # abi 0 and a reason where there is none
    interpreter_rules(exe, stdlib) -> [(path, rights)]  # what a Python interpreter needs to start
    restrict(libc, get_errno, abi, rules, writable, tcp_connect=())   # this process, for good

Landlock (include/uapi/linux/landlock.h, Linux >= 5.13) lets an unprivileged process build a
ruleset of (file hierarchy, rights) and (TCP port, connect) rules and restrict itself to it;
everything it execs afterwards inherits the restriction, and nothing can lift it. Two jails use
it, each with its own rules: sandbox.py's harness child (READ the interpreter, its libraries
and the stdlib, READ+WRITE its scratch dir, no TCP at all) and agent_jail.py's coding agent
(READ the system and its own installation, READ+WRITE its copy of the archive and its home,
TCP connect to port 443).

restrict() runs in a forked child before exec: it touches no file but the ones it grants and
imports nothing, so the caller loads ctypes and this module first (isolation.plan builds libc).

What it leaves out: Landlock (ABI <= 7) does not cover file metadata (stat, access, readlink:
any path's existence and size stay visible), chdir, UDP or raw sockets, or connecting to a
path-based unix socket; the callers leave those to other layers. A rule grants a whole
hierarchy and cannot carve holes, so a caller that must hide something inside a granted
directory grants that directory's children one by one (agent_jail._grant_around).
"""
import os
import stat
import sys

# syscall numbers (the same on every architecture), ruleset attribute fields by ABI version,
# access rights
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION, RULE_PATH_BENEATH, RULE_NET_PORT = 1, 1, 2
PR_SET_NO_NEW_PRIVS = 38
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_DIR, FS_MAKE_REG = 1 << 4, 1 << 5, 1 << 7, 1 << 8
FS_ABI1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM: everything ABI 1 knows (also char/block/fifo/socket/symlink)
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # since ABI 2, 3, 5
FS_ON_FILES = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # a rule on a file
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # since ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # since ABI 6
# a writable directory: read, write, create and remove files and directories in it; no exec,
# devices, fifos, sockets or symlinks
WRITABLE_DIR = (FS_READ_FILE | FS_READ_DIR | FS_WRITE_FILE | FS_TRUNCATE | FS_MAKE_REG | FS_MAKE_DIR
                | FS_REMOVE_FILE | FS_REMOVE_DIR | FS_REFER)


def version(libc, get_errno):
    """(the kernel's Landlock ABI, None) or (0, why there is none)."""
    abi = libc.syscall(SYS_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
    if abi >= 1:
        return abi, None
    e = get_errno()
    return 0, {38: "this kernel has no Landlock (ENOSYS)",
               95: "Landlock is disabled in this kernel (EOPNOTSUPP)"}.get(
        e, f"landlock_create_ruleset failed ({os.strerror(e)})")


def elf_interpreter(path):
    """The dynamic loader an ELF executable names in its PT_INTERP header (None: static or not ELF).
    The kernel opens it for execution, so it needs Landlock's EXECUTE right."""
    import struct
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only
            return None
        end = "<" if head[5] == 1 else ">"
        (phoff,), (phentsize, phnum) = struct.unpack_from(end + "Q", head, 32), struct.unpack_from(end + "HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for k in range(phnum):
            p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(end + "IIQQQQ", table, k * phentsize)
            if p_type == 3:  # PT_INTERP
                f.seek(p_offset)
                return os.path.realpath(f.read(p_filesz).rstrip(b"\0").decode())
    return None


def interpreter_rules(exe, stdlib):
    """(path, rights) a Python interpreter needs to start and import the standard library, nothing
    else. Found with strace on `python -s -S -B -P -c 'import json, threading, sqlite3 ...'` under
    the ruleset: ld.so, its cache, libc/libm (+ the libraries lib-dynload links: libz, libffi,
    libsqlite3 ...), libpython, the stdlib. Left out on purpose: /proc and /sys (CPython does not
    need them to start), locale files and /etc/localtime (sandbox.py's child runs in the C locale,
    i.e. Python's UTF-8 mode, and in UTC), site-packages."""
    import sysconfig
    ro = FS_READ_FILE | FS_READ_DIR
    rules = [(exe, FS_READ_FILE | FS_EXECUTE), (stdlib, FS_READ_DIR)]
    loader = elf_interpreter(exe)
    if loader:
        rules.append((loader, FS_READ_FILE | FS_EXECUTE))
    # A rule grants a whole hierarchy and cannot carve holes, so the stdlib is granted entry by
    # entry, leaving out the third-party packages.
    rules += [(os.path.realpath(os.path.join(stdlib, n)), ro) for n in sorted(os.listdir(stdlib))
              if n not in ("site-packages", "dist-packages")]
    rules += [(os.path.realpath(p), FS_READ_FILE) for p in sys.path if p.endswith(".zip") and os.path.isfile(p)]
    arch = getattr(sys.implementation, "_multiarch", "") or "."
    lib_dirs = sorted({os.path.realpath(d) for d in ("/lib64", "/usr/lib64", f"/lib/{arch}", f"/usr/lib/{arch}")
                       if os.path.isdir(d)})
    rules += [(d, FS_READ_FILE) for d in lib_dirs]
    libdir = os.path.realpath(sysconfig.get_config_var("LIBDIR") or "/nonexistent")
    if os.path.isdir(libdir) and libdir not in lib_dirs:  # libpython (pyenv), or a conda env's own libraries
        rules += [(os.path.join(libdir, n), FS_READ_FILE) for n in sorted(os.listdir(libdir))
                  if ".so" in n and os.path.isfile(os.path.join(libdir, n))]
    return rules + [("/etc/ld.so.cache", FS_READ_FILE), ("/dev/null", FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE)]


def restrict(libc, get_errno, abi, rules, writable, tcp_connect=()):
    """Restrict this process and everything it execs, for good, to `rules` ([(path, rights)]),
    WRITABLE_DIR on each of `writable` and TCP connect to the ports in `tcp_connect` (ABI >= 4;
    none: no TCP at all); ABI >= 6 also scopes signals and abstract unix sockets to the process's
    own domain. A path that does not exist is skipped. Raises OSError on failure."""
    import struct  # (already loaded by the caller: no file access here)

    def check(ret, what):
        if ret < 0:
            e = get_errno()
            raise OSError(e, f"{what}: {os.strerror(e)}")
        return ret

    fs = FS_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (FS_IOCTL_DEV if abi >= 5 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0  # no rule allows a port: no TCP at all
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0  # only within the domain
    attr = struct.pack("QQQ", fs, net, scoped)[:8 if abi < 4 else 16 if abi < 6 else 24]  # the ABI's struct size
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")  # required unprivileged
    ruleset = check(libc.syscall(SYS_CREATE_RULESET, attr, len(attr), 0), "landlock_create_ruleset")
    try:
        for path, rights in list(rules) + [(w, WRITABLE_DIR) for w in writable]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    rights &= FS_ON_FILES
                rule = struct.pack("=Qi", rights & fs, fd)  # struct landlock_path_beneath_attr (packed)
                check(libc.syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, rule, 0), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        for port in tcp_connect if net else ():  # struct landlock_net_port_attr
            check(libc.syscall(SYS_ADD_RULE, ruleset, RULE_NET_PORT, struct.pack("QQ", NET_CONNECT_TCP, port), 0),
                  f"landlock_add_rule port {port}")
        check(libc.syscall(SYS_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)
