"""agent_jail.py: run the command proposer's coding agent confined, and end it by its deadline.

    run_agent(command, cwd, home, prompt, timeout, env_names=(), private=()) -> dict(out, err, rc, ...)

The agent (Claude Code's `claude -p`, Codex's `codex exec`, a test's stand-in) is untrusted
code with the user's credentials. It runs through a small launcher (this file, run as a script)
that builds its cell and then waits for it:
- a PID namespace (as root): the agent's shell is PID 1 of its own namespace, so when it exits,
  or when the launcher is killed at the deadline (PR_SET_PDEATHSIG links them), the kernel kills
  every process in it, daemons that called setsid included. A fresh /proc shows only them, so
  the parent's /proc/PID/environ (its secrets) is not there to read.
- Landlock (landlock.py, another rule set than sandbox.py's): READ and EXECUTE the system (/usr,
  /bin, /lib*, /etc, /opt, /sys, a fresh /proc, the few /dev files a CLI uses), the agent's own
  installation (the directory its executable and its script interpreter live in; a bin/ with a
  lib/ beside it means the prefix above, e.g. a pyenv or node prefix) and the files its command
  line names; READ and WRITE only `cwd` (its copy of the archive) and `home` (its HOME and
  TMPDIR). Nothing else: not the repository (its data/ holds the test split), not WHALE_DATA,
  not the run directory, not the user's home, not /tmp. A granted directory that holds one of
  `private` is granted child by child around it (a Landlock rule cannot carve holes). Network
  (ABI >= 4): TCP connect to port 443 only, no bind, so no other local service; ABI >= 6: no
  signals or abstract unix sockets outside the cell.
- a scrubbed environment: PATH, LANG/LC_*, TERM, TZ, USER/LOGNAME, SHELL, HOME and TMPDIR
  pointing at `home`, plus exactly the variables the user names (--proposer-env).
- the deadline bounds everything: at `timeout` the launcher's process group is killed (PID 1
  with it, so the namespace), and the final read of its output waits at most GRACE_S more.

Where a layer is missing (not root: no PID namespace; no Landlock in the kernel; Landlock ABI
< 4: no network rule) the parent prints one warning line per missing layer and runs the agent
with what is left; WHALE_SANDBOX_NO_LANDLOCK=1 turns Landlock off here too (tests use it to
show the layers behind it). What it leaves out: UDP (DNS must work), path-based unix sockets
and file metadata (Landlock does not cover them), CPU/memory limits, a user namespace for
non-root users; the agent runs as the user, so files Landlock grants are as writable as the
user's permissions make them (only cwd and home are granted for writing).
"""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import isolation
import landlock
from sandbox_child import under

GRACE_S = 5.0        # after the kill: how long the last read of the agent's output may take
TCP_PORTS = (443,)   # the only TCP ports the agent may connect to (HTTPS to its API)
KEEP_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "USER", "LOGNAME", "SHELL")
SYSTEM_READ = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/etc", "/opt", "/sys", "/proc")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/ptmx", "/dev/pts")


def agent_env(home, names=()):
    """The agent's environment: what a CLI needs to start, HOME/TMPDIR in its own directory, and
    the variables the user named (a named variable that is not set is left out)."""
    env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update(HOME=home, TMPDIR=home)
    env.update({k: os.environ[k] for k in names if k in os.environ})
    return env


def _install_dir(path):
    """Where an executable lives: its directory, or the prefix above a bin/ that has a lib/ beside it."""
    d = os.path.dirname(os.path.realpath(path))
    parent = os.path.dirname(d)
    return parent if os.path.basename(d) == "bin" and os.path.isdir(os.path.join(parent, "lib")) else d


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


def jail_rules(command, env, private):
    """The Landlock (path, rights) list of the agent, besides its own directories."""
    ro = landlock.FS_READ_FILE | landlock.FS_READ_DIR | landlock.FS_EXECUTE
    private = [os.path.realpath(p) for p in private if p]
    grants = [d for d in SYSTEM_READ if os.path.exists(d)]
    words = shlex.split(command) if command.strip() else []
    exe = shutil.which(words[0], path=env.get("PATH")) if words else None
    programs = [p for p in [exe, exe and _interpreter(exe)] if p]
    grants += [_install_dir(p) for p in programs]
    grants += [w for w in words[1:] if os.path.isfile(w)]  # `python agent.py`: the script it names
    rules = []
    for g in dict.fromkeys(grants):
        rules += _grant_around(g, ro, private)
    rw = landlock.FS_READ_FILE | landlock.FS_WRITE_FILE | landlock.FS_TRUNCATE | landlock.FS_IOCTL_DEV
    return rules + [(d, rw | landlock.FS_READ_DIR) for d in DEVICES if os.path.exists(d)]


def run_agent(command, cwd, home, prompt, timeout, env_names=(), private=()):
    """Run `command` (a shell line) in `cwd` with the prompt on stdin, confined as the module
    docstring says; never longer than timeout + GRACE_S. Returns dict(out, err, rc, timed_out,
    notes, landlock, pid_ns); notes = what went wrong around the agent (output abandoned);
    landlock = the ABI the jail used (0: none), pid_ns = whether it had a PID namespace."""
    plan = isolation.plan()
    env = agent_env(home, env_names)
    landlock = isolation.landlock_abi(plan)
    if not landlock:
        isolation.warn_once("agent_jail", f"{plan['landlock_off'] or 'WHALE_SANDBOX_NO_LANDLOCK is set'}: the "
                            "proposer's agent runs without its Landlock jail (it can read and write what its user can)")
    elif landlock < 4:
        isolation.warn_once("agent_jail", f"Landlock ABI {landlock} < 4: the proposer's agent may connect to any "
                            "TCP port")
    if not plan["root"]:
        isolation.warn_once("agent_jail", "not root: no PID namespace for the proposer's agent; a daemon it starts "
                            "outside its process group may outlive the call")
    spec = dict(command=command, pid_ns=plan["root"], landlock=landlock, ports=list(TCP_PORTS),
                rules=jail_rules(command, env, private) if landlock else [],
                writable=[os.path.realpath(cwd), os.path.realpath(home)])
    argv = [plan["exe"], "-s", "-B", os.path.realpath(__file__), json.dumps(spec)]
    notes, timed_out = [], False
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
                            preexec_fn=lambda: plan["libc"].prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
    try:
        out, err = proc.communicate(prompt, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and PID 1: the namespace goes with them
        except OSError:
            pass
        try:
            out, err = proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:  # a process outside the kill still holds the pipes
            for f in (proc.stdout, proc.stderr):
                f.close()
            proc.wait(GRACE_S)
            out, err = "", ""
            notes.append("a process the agent started still held its output after the kill; output abandoned")
    return dict(out=out or "", err=err or "", rc=proc.returncode, timed_out=timed_out, notes=notes,
                landlock=landlock, pid_ns=plan["root"])


# -----------------------------------------------------------------------------
# The launcher (this file run as a script, outside the jail): build the cell, run the agent, wait.

def _launch(spec):
    p = isolation.plan()
    libc = p["libc"]
    pid_ns = spec["pid_ns"] and libc.unshare(isolation.CLONE_NEWPID | isolation.CLONE_NEWNS) == 0
    if spec["pid_ns"] and not pid_ns:
        print(f"agent_jail: WARNING: no PID namespace ({os.strerror(p['get_errno']())})", file=sys.stderr, flush=True)
    pid = os.fork()
    if pid == 0:  # PID 1 of the new namespace (or a plain child without one)
        try:
            libc.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher killed: PID 1 dies
            if pid_ns:  # a /proc of this namespace only, in a mount namespace of its own
                proc_flags = isolation.MS_NOSUID | isolation.MS_NODEV | isolation.MS_NOEXEC
                if libc.mount(None, b"/", None, isolation.MS_REC | isolation.MS_PRIVATE, None) or \
                        libc.mount(b"proc", b"/proc", b"proc", proc_flags, None):
                    print(f"agent_jail: WARNING: no /proc of its own ({os.strerror(p['get_errno']())}): the host's "
                          "processes are visible to the agent", file=sys.stderr, flush=True)
            if spec["landlock"]:
                landlock.restrict(libc, p["get_errno"], spec["landlock"], [tuple(r) for r in spec["rules"]],
                                  spec["writable"], spec["ports"])
            os.execv("/bin/sh", ["sh", "-c", spec["command"]])
        except BaseException as e:
            print(f"agent_jail: could not start the agent: {e}", file=sys.stderr, flush=True)
        os._exit(127)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]))
