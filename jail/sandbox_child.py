"""
sandbox_child.py: the code that runs inside the sandbox process (sandbox.py is the parent side).

The parent opens this file and hands the child an inherited descriptor to it; the child's
interpreter (-s -S: no site-packages) reads it from there and runs it as __main__ with --child
(sandbox._BOOT): Landlock and the tmpfs covers keep it from opening any file of the repository
by path. So what runs next to the harness is this file and nothing else of WHALE: a harness that
reaches sys.modules["__main__"] finds the child's loop, the audit hook's inputs and the protocol,
never the parent's spawning code.

  protocol    length-prefixed JSON frames both ways (frame), their caps (MAX_MSG, MAX_DEPTH:
              too_deep checks nesting iteratively), ToolError (what a refused call raises in the
              harness), valid_text (the one text rule, also used by the parent at every boundary);
  lock-down   _lock_down: RLIMIT_NPROC=0, stdlib-only imports, the audit hook
              (_make_audit_hook: a flat function whose inputs are immutable default
              arguments), print() into a capped buffer, a recursion cap;
  the loop    _child_main: say hello, take the init message; mode "rollouts": _route, the
              router, forks one process per rollout (_rollout_process: its own socket and
              directory, lock-down, a fresh import of the harness, run(task, llm, tools) once,
              each llm()/tools.<name>() call a message to the parent and a wait for its reply)
              and relays their checked frames; mode "python": run one piece of code.

Keep its module-level imports light and never import subprocess or ctypes at module level (a
harness could reach them through sys.modules). What it protects against, and what it does not:
sandbox.py's docstring (the layers, the attack table, the known ways past the hook).
"""
import json
import os
import resource
import sys
import threading
import traceback
import types

MAX_MSG = 4 << 20            # bytes per pipe message, either direction
MAX_DEPTH = 32               # nesting of lists/dicts in any message from the child (checked iteratively,
                             # right after decoding, so nothing recursive ever sees deeper data)
ANSWER_CHARS = 10_000
STDOUT_CHARS = 2_000
ERROR_CHARS = 2_000
NOFILE_ROLLOUT = 64          # open files of one rollout process
# stdlib modules the router imports before it forks, so that rollout processes share them
PRELOAD = ("re", "json", "math", "string", "collections", "itertools", "functools", "textwrap")  # (not random:
# its state would be the same in every rollout)
RECURSION_CAP = 2000         # sys.setrecursionlimit is capped so deep recursion through C code
                             # (__getattr__, __str__ ...) raises RecursionError instead of overflowing
                             # a thread's stack (measured: ~700 bytes of C stack per level)


class ToolError(Exception):
    """Raised inside a harness when the parent refuses or fails an llm() or tools.<name>() call."""


def last_line(e):
    """'TypeError: ...' for an exception: the last line of its traceback, capped."""
    try:
        line = traceback.format_exception_only(type(e), e)[-1].strip()
    except Exception:
        line = type(e).__name__
    return valid_text(line[:ERROR_CHARS], replace=True)


def valid_text(s, what="text", replace=False):
    """The one text rule, for every string that reaches this process from a harness child or a
    proposer (a prompt, a system message, stop strings, tool arguments, printed output, an
    error, an answer, a candidate's source, a proposer's reply) before it goes on to the
    tokenizer, a trace, the archive or a log. The text must be valid Unicode, i.e. encodable as
    UTF-8. In a Python str the one thing that is not is a surrogate code point U+D800-U+DFFF
    (json.loads makes one from a "\\ud800" escape, a surrogateescape decode from a stray byte);
    the tokenizer raises TypeError on it and a UTF-8 file or terminal UnicodeEncodeError.
    Returns s when it is valid. Otherwise: replace=True returns s with each surrogate replaced
    by U+FFFD (for text that records what happened: output, errors, answers, traces, which
    must be kept); replace=False raises ValueError naming `what` and the first bad position
    (for text that is an input to something: a prompt is refused, a candidate is invalid, a
    proposer's reply is a failed call). Non-str values are returned unchanged."""
    if not isinstance(s, str):
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError as e:
        if not replace:
            raise ValueError(f"{what} is not valid Unicode (a lone surrogate U+{ord(s[e.start]):04X} "
                             f"at character {e.start})") from None
        return "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in s)


def frame(msg):
    data = json.dumps(msg).encode()
    return len(data).to_bytes(4, "big") + data


def too_deep(obj, limit=MAX_DEPTH):
    """True if lists/dicts in obj nest deeper than limit. Iterative: a message nested 100,000
    deep costs a loop, not the stack (json.dumps, copies and the trace writer all recurse)."""
    if not isinstance(obj, (list, tuple, dict)):
        return False
    todo = [(obj, 1)]
    while todo:
        x, depth = todo.pop()
        if depth > limit:
            return True
        for v in x.values() if isinstance(x, dict) else x:
            if isinstance(v, (list, tuple, dict)):
                todo.append((v, depth + 1))
    return False


def under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


# ----------------------------------------------------------------------------------------
# The lock-down and the child's loop

_BLOCKED_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
    "os.killpg", "subprocess.Popen", "pty.spawn", "resource.setrlimit", "resource.prlimit",
    "os.link", "os.symlink", "os.chmod", "os.chown", "os.chflags", "os.lchflags",
    "os.setxattr", "os.removexattr", "os.getxattr", "os.listxattr",
    "cpython.PyInterpreterState_New",  # a sub-interpreter would run without our hook
    # the ways to reach this hook's closure cells from Python (the function object is referenced
    # only by the interpreter; frames do not expose it) or to rewrite its frame's variables:
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace", "sys.setprofile",
    "sqlite3.enable_load_extension", "sqlite3.load_extension",
})
_BLOCKED_PREFIXES = ("socket.", "ctypes.")
# Loaded before the lock-down, then stripped of what signals another process by pidfd (the hook
# sees os.kill, not these; Landlock's signal scope needs ABI 6): importing them again, which would
# bring the functions back, is refused.
_NO_RELOAD = frozenset({"os", "posix", "signal", "_signal"})
_STRIPPED = (("posix", "pidfd_open"), ("os", "pidfd_open"), ("_signal", "pidfd_send_signal"),
             ("signal", "pidfd_send_signal"))
_BLOCKED_MODULES = frozenset({
    "ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_testcapi", "_testinternalcapi",
    "_testbuffer", "_testmultiphase", "_testimportmultiple", "_ctypes_test", "_xxtestfuzz",
    "_gdbm", "_dbm", "readline", "syslog", "_posixshmem",  # open files/sockets in C, unaudited
})
# event -> (index of a path argument, needs write access)
_PATH_EVENTS = {
    "os.listdir": ((0, False),), "os.scandir": ((0, False),), "os.chdir": ((0, False),),
    "os.mkdir": ((0, True),), "os.rmdir": ((0, True),), "os.remove": ((0, True),),
    "os.rename": ((0, True), (1, True)), "os.truncate": ((0, True),), "os.utime": ((0, True),),
    "sqlite3.connect": ((0, True),),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _make_audit_hook(scratch, read_roots, deny_roots):
    """The policy as one flat function whose every input is a default argument bound now: strings,
    tuples, frozensets, ints and builtin functions, none of them mutable. It reads no global name
    and has no closure, so rebinding anything in this module, in os/posixpath or in builtins
    (all reachable by the harness, e.g. via sys.modules["__main__"]) does not change it, and its
    frame (reachable from the traceback of every PermissionError it raises) holds nothing it could
    be reprogrammed through. It resolves paths itself (os.path.realpath looks its helpers up in
    posixpath at call time). What still defeats it is listed in the module docstring."""
    path_events = tuple((event, tuple(specs)) for event, specs in _PATH_EVENTS.items())

    def hook(event, args, scratch=scratch, scratch_dir=scratch + "/",
             read_roots=frozenset(read_roots), read_dirs=tuple(r + "/" for r in read_roots),
             deny_roots=frozenset(deny_roots), deny_dirs=tuple(r + "/" for r in deny_roots),
             blocked=_BLOCKED_EVENTS, prefixes=_BLOCKED_PREFIXES, modules=_BLOCKED_MODULES, no_reload=_NO_RELOAD,
             path_event_names=frozenset(e for e, _ in path_events), path_events=path_events,
             write_flags=_WRITE_FLAGS, getcwd=os.getcwd, lstat=os.lstat, readlink=os.readlink,
             os_stat=os.stat, type=type, str=str, bytes=bytes, int=int,
             PermissionError=PermissionError, OSError=OSError):
        if event in blocked or event.startswith(prefixes):
            raise PermissionError(f"sandbox: {event} is blocked")
        if event == "open":
            path, mode, flags = args
            write = (type(flags) is int and flags & write_flags != 0) or (type(mode) is str and (
                "w" in mode or "a" in mode or "x" in mode or "+" in mode))
            todo = [(path, write)]
        elif event == "import":
            name = args[0]
            if type(name) is not str or name.partition(".")[0] in modules or name in no_reload:
                raise PermissionError(f"sandbox: import of {name} is blocked")
            if args[1] is None:
                return
            todo = [(args[1], False)]  # an extension module: only the stdlib's own
        elif event in path_event_names:
            todo = []
            for name, specs in path_events:
                if name == event:
                    for k, write in specs:
                        todo.append((args[k] if args[k] is not None else ".", write))
        else:
            return
        for path, write in todo:
            if type(path) is int:
                continue  # an already-open descriptor: its path was checked when it was opened
            if type(path) is bytes:
                path = path.decode("utf-8", "surrogateescape")
            elif type(path) is not str:
                raise PermissionError("sandbox: paths must be str or bytes")
            # resolve symlinks and .. like os.path.realpath (a missing component stays as written)
            if not path.startswith("/"):
                path = getcwd() + "/" + path
            parts, done, links = path.split("/")[::-1], [], 0
            while parts:
                part = parts.pop()
                if part == "" or part == ".":
                    continue
                if part == "..":
                    if done:
                        done.pop()
                    continue
                done.append(part)
                here = "/" + "/".join(done)
                try:
                    is_link = lstat(here).st_mode & 0o170000 == 0o120000
                except OSError:
                    continue
                if is_link:
                    links += 1
                    if links > 40:
                        raise PermissionError("sandbox: too many levels of symbolic links")
                    target = readlink(here)
                    done.pop()
                    if target.startswith("/"):
                        done = []
                    parts.extend(target.split("/")[::-1])
            p = "/" + "/".join(done)
            if not (p == scratch or p.startswith(scratch_dir)):
                if write or not (p in read_roots or p.startswith(read_dirs)) or (
                        p in deny_roots or p.startswith(deny_dirs)):
                    raise PermissionError(f"sandbox: access to {p!r} is blocked")
            if event == "open":
                try:
                    is_dir = os_stat(p).st_mode & 0o170000 == 0o040000
                except OSError:
                    is_dir = False
                if is_dir:  # a directory fd would let dir_fd= calls escape the path check
                    raise PermissionError("sandbox: opening directories is blocked")

    return hook


class _Capture:
    """sys.stdout / sys.stderr in the child: print() writes into a capped buffer (per thread: run_python's)."""

    def __init__(self, local, cap):
        self.local, self.cap = local, cap
        self.encoding, self.errors = "utf-8", "replace"

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        buf = getattr(self.local, "buf", None)
        if buf is not None and buf[0] < self.cap:
            buf.append(s[:self.cap - buf[0]])
            buf[0] += len(buf[-1])
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return False

    def text(self):
        buf = getattr(self.local, "buf", None) or [0]
        return "".join(buf[1:])


def _lock_down(scratch, max_output, recursion_cap, extra_reads=()):
    """Last step before harness code runs: no new processes or threads, stdlib-only imports,
    the audit hook (read-write in scratch; read-only in the stdlib and extra_reads), print()
    into a capped buffer, a capped recursion limit."""
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # threads are processes to the kernel
    import _thread

    def no_threads(*args, **kwargs):
        """Also refused in Python, for when the child had to stay root (root ignores NPROC)."""
        raise RuntimeError("can't start new thread")
    _thread.start_new_thread = _thread.start_new = threading._start_new_thread = no_threads
    real_setrecursionlimit = sys.setrecursionlimit

    def setrecursionlimit(limit):
        """Capped in the sandbox: deeper recursion would overflow the C stack and kill the batch."""
        real_setrecursionlimit(min(limit, recursion_cap))
    sys.setrecursionlimit = setrecursionlimit
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    deny = (stdlib + "/site-packages", stdlib + "/dist-packages")
    read_roots = (stdlib, *extra_reads) + tuple(os.path.realpath(p) for p in sys.path if p.endswith(".zip"))
    sys.path[:] = [p for p in sys.path if under(os.path.realpath(p), stdlib) or p.endswith(".zip")]
    sys.path_importer_cache.clear()
    sys.dont_write_bytecode = True
    for name in _BLOCKED_MODULES | {"subprocess"}:
        if name in sys.modules:  # a cached module is imported again without an "import" event
            raise RuntimeError(f"sandbox child imported {name} before lock-down")
    import signal  # noqa: F401  (cached now: a harness's `import signal` raises no event)
    for module, name in _STRIPPED:
        sys.modules[module].__dict__.pop(name, None)
    sys.addaudithook(_make_audit_hook(scratch, read_roots, deny))
    sys.stdout = sys.stderr = capture = _Capture(threading.local(), max_output)
    return capture


def read_frames(buf):
    """Cut the complete frames off the front of buf (a bytearray, consumed in place) and decode
    them: -> (messages, error). error is the first protocol violation ('message length ...',
    'undecodable message (...)', 'message is not a JSON object', 'message nested deeper ...');
    then the messages before it are still returned. Used on both sides: by the parent on the
    child's pipe, and by the child's router on each rollout's socket."""
    msgs = []
    while len(buf) >= 4:
        n = int.from_bytes(buf[:4], "big")
        if n > MAX_MSG:
            return msgs, f"message length {n} over the {MAX_MSG} byte cap"
        if len(buf) < 4 + n:
            break
        body = bytes(buf[4:4 + n])
        del buf[:4 + n]
        try:
            msg = json.loads(body)
        except Exception as e:  # includes RecursionError from absurd nesting
            return msgs, f"undecodable message ({type(e).__name__})"
        if not isinstance(msg, dict):
            return msgs, "message is not a JSON object"
        if too_deep(msg):  # before anything recursive (validation, records, traces) sees it
            return msgs, f"message nested deeper than {MAX_DEPTH} levels"
        msgs.append(msg)
    return msgs, None


def write_frame(fd, data):
    """Write one frame (bytes from frame()) to a blocking descriptor, all of it."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd):
    """Read one frame from a blocking descriptor; the other end gone: this process ends."""
    def read(k):
        out = bytearray()
        while len(out) < k:
            chunk = os.read(fd, k - len(out))
            if not chunk:
                os._exit(0)
            out += chunk
        return out
    return json.loads(read(int.from_bytes(read(4), "big")))


def _child_main(rfd, wfd):
    def send(msg):
        write_frame(wfd, frame(msg))

    def recv():
        return read_frame(rfd)

    send({"t": "hello", "uid": os.getuid()})
    init = recv()
    scratch = os.path.realpath(os.getcwd())
    if init["mode"] == "python":
        capture = _lock_down(scratch, init["max_output"], 2 * RECURSION_CAP)  # main thread: 8 MB stack
        capture.local.buf, error = [0], None
        try:
            exec(compile(init["code"], "<python>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            error = None if e.code in (None, 0) else last_line(e)
        except BaseException as e:
            error = last_line(e)
        send({"t": "done", "stdout": capture.text(), "error": error})
        os._exit(0)
    _route(init, rfd, send, scratch)


# ----------------------------------------------------------------------------------------
# One process per rollout: the router (this process, which runs no harness code) and the
# rollout processes it forks

def _rollout_process(sock, rid, job, code, path, scratch):
    """The body of one forked rollout process: keep only its own socket, lock down into its own
    directory, import the harness afresh, run it once, say done. Never returns.
    job None: the probe, which only imports the harness and says whether it defines run()."""
    try:
        os.closerange(3, sock)  # the parent's pipe, the other rollouts' sockets: not this one's to use
        os.closerange(sock + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE_ROLLOUT, NOFILE_ROLLOUT))
        home = os.path.join(scratch, f"r{rid}")
        os.mkdir(home, 0o700)
        os.chdir(home)
    except BaseException:
        os._exit(3)

    def send(msg):
        data = frame(msg)
        if len(data) > MAX_MSG:
            raise ToolError(f"message of {len(data)} bytes is over the {MAX_MSG} byte cap")
        write_frame(sock, data)

    def call(payload):
        """Send one llm/tool call to the parent (through the router) and wait for its reply."""
        if too_deep(payload):  # the router would call it a protocol violation and end this rollout
            raise ToolError(f"arguments nested too deep (a call may nest {MAX_DEPTH} levels in all)")
        try:
            send(dict(payload, t="call", rid=rid))
        except (TypeError, ValueError) as e:
            raise ToolError(f"arguments must be JSON-serialisable: {e}") from None
        reply = read_frame(sock)
        if not reply["ok"]:
            raise ToolError(reply["error"])
        return reply["value"]

    def llm(messages, max_tokens=256, stop=None, n=None):
        """One model call; the parent applies the chat template and samples. n=k: a list of
        k replies to the same prompt, sampled together."""
        return call({"kind": "llm", "messages": messages, "max_tokens": max_tokens, "stop": stop, "n": n})

    def make_tool(name):
        def tool(*args, **kwargs):
            return call({"kind": "tool", "name": name, "args": list(args), "kwargs": kwargs})
        tool.__name__ = name
        return tool

    capture = _lock_down(home, STDOUT_CHARS, RECURSION_CAP, extra_reads=(path,))
    capture.local.buf = [0]  # module-level prints of the harness: captured and dropped
    status, answer, error = "ok", None, None
    try:
        module = types.ModuleType("harness")
        module.__file__ = path
        module.ToolError = ToolError  # so a harness can write `except ToolError:`
        sys.modules["harness"] = module
        exec(code, module.__dict__)
        run = module.__dict__.get("run")
        if job is None:
            send({"t": "ready", "error": None if callable(run) else "harness defines no run(task, llm, tools)"})
            os._exit(0)
        capture.local.buf = [0]
        tools = types.SimpleNamespace(**{name: make_tool(name) for name in job["tools"]})
        out = run(job["task"], llm, tools)
        if isinstance(out, (str, int, float)):  # anything else is no answer
            answer = str(out)[:ANSWER_CHARS]
    except BaseException as e:  # SystemExit too: it must not end the rollout silently
        if job is None:
            send({"t": "ready", "error": last_line(e)})
            os._exit(0)
        status, error = "error", last_line(e)
    send({"t": "done", "rid": rid, "status": status, "answer": answer, "error": error,
          "stdout": capture.text()[:STDOUT_CHARS]})
    os._exit(0)


def _route(init, rfd, send_parent, scratch):
    """The child's main loop in "rollouts" mode. It forks one process per rollout (at most
    init["processes"] at a time, in job order) and relays frames between them and the parent: a
    rollout's frames are decoded and checked here (each must be a call or done of its own rid), so
    a rollout that writes garbage, forges another rid or dies costs that rollout alone. The parent
    may ask for a rollout to be killed (its deadline passed). Every rollout process ends with one
    "done" to the parent: its own, or one this loop writes ("crash", "protocol")."""
    import select
    import signal
    import time
    path = os.path.join(scratch, "harness.py")
    with open(path, "w") as f:  # read-only for the rollouts: tracebacks show its lines
        f.write(init["source"])
    try:
        code = compile(init["source"], path, "exec")
    except BaseException as e:
        send_parent({"t": "ready", "error": last_line(e)})
        code = None
    jobs, slots = init["jobs"], init["processes"]
    live = {}  # socket fd -> {"rid", "pid", "inbuf", "outbuf", "bad", "done"}
    by_rid = {}
    queue = iter(range(len(jobs)))  # the parent starts its rollouts in the same order
    parent_in = bytearray()
    os.set_blocking(rfd, False)
    poller = select.poll()
    poller.register(rfd, select.POLLIN)

    def spawn(rid, job):
        import socket  # here only: a rollout process closes every socket of its siblings first
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            mine.detach()
            _rollout_process(theirs.detach(), rid, job, code, path, scratch)
        theirs.close()
        fd = mine.detach()
        os.set_blocking(fd, False)
        live[fd] = {"rid": rid, "pid": pid, "inbuf": bytearray(), "outbuf": bytearray(), "bad": None, "done": False}
        by_rid[rid] = fd
        poller.register(fd, select.POLLIN)

    def end(fd, why=None):
        """Kill and reap one rollout process; say done for it unless it already did."""
        w = live.pop(fd)
        by_rid.pop(w["rid"], None)
        poller.unregister(fd)
        os.close(fd)
        rc = None
        if not w["done"] and w["bad"] is None and why is None:  # its socket closed: give it 50 ms to exit
            for _ in range(50):
                pid, rc = os.waitpid(w["pid"], os.WNOHANG)
                if pid:
                    break
                rc = None
                time.sleep(0.001)
            if rc is None:
                why = "rollout process closed its socket"
        if rc is None:
            try:
                os.kill(w["pid"], signal.SIGKILL)
            except OSError:
                pass
            rc = os.waitpid(w["pid"], 0)[1]
        if w["rid"] != "probe":
            rid = next(queue, None)  # its place goes to the next job
            if rid is not None:
                spawn(rid, jobs[rid])
        if w["done"]:
            return
        if w["bad"] is not None:
            status, error = "protocol", f"protocol violation: {w['bad']}"
        elif why is not None:
            status, error = "crash", why
        elif os.WIFSIGNALED(rc):
            status, error = "crash", f"rollout process killed by {signal.Signals(os.WTERMSIG(rc)).name}"
        else:
            status, error = "crash", f"rollout process exited with code {os.WEXITSTATUS(rc)}"
        if w["rid"] == "probe":
            send_parent({"t": "ready", "error": f"harness module: {error}"})
        else:
            send_parent({"t": "done", "rid": w["rid"], "status": status, "answer": None, "error": error,
                         "stdout": "", "pid": w["pid"]})

    def from_rollout(fd, w, msg):
        t = msg.get("t")
        if w["rid"] == "probe":
            if t != "ready" or not (msg.get("error") is None or isinstance(msg.get("error"), str)):
                raise ValueError("unexpected message from the harness import")
            w["done"] = True
            send_parent({"t": "ready", "error": msg["error"]})
            if msg["error"] is None:
                for rid in [next(queue) for _ in range(min(slots, len(jobs)))]:
                    spawn(rid, jobs[rid])
            return
        if t not in ("call", "done") or msg.get("rid") != w["rid"]:
            raise ValueError(f"unexpected message {t[:40] if isinstance(t, str) else type(t).__name__!r} "
                             "(a rollout may speak only for itself)")
        if t == "done":
            if msg.get("status") not in ("ok", "error"):
                raise ValueError("malformed done message")
            w["done"] = True
        send_parent(msg)

    # Memory: a rollout process shares the router's pages until it writes to them. So the
    # modules harnesses import are imported once here, and gc.freeze() keeps the collector from
    # writing to every object the rollout processes inherit (measured: tools/bench.py --only isolation).
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    import gc
    gc.freeze()
    if code is not None:
        spawn("probe", None)
    while True:
        for fd, ev in poller.poll(1000):
            if fd == rfd:
                try:
                    data = os.read(rfd, 1 << 20)
                except BlockingIOError:
                    continue
                if not data:
                    os._exit(0)  # the parent is gone
                parent_in += data
                msgs, _ = read_frames(parent_in)  # (the parent is trusted: its frames are well formed)
                for msg in msgs:
                    fd2 = by_rid.get(msg.get("rid"))
                    if fd2 is None:
                        continue  # the rollout has ended already
                    if msg.get("t") == "kill":  # its deadline passed
                        end(fd2, "killed at its deadline")
                    else:
                        live[fd2]["outbuf"] += frame(msg)
                        poller.modify(fd2, select.POLLIN | select.POLLOUT)
                continue
            w = live.get(fd)
            if w is None:
                continue
            if ev & select.POLLOUT and w["outbuf"]:
                try:
                    del w["outbuf"][:os.write(fd, w["outbuf"])]
                except BlockingIOError:
                    pass
                except OSError:
                    w["outbuf"].clear()
                if not w["outbuf"]:
                    poller.modify(fd, select.POLLIN)
            if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                try:
                    data = os.read(fd, 1 << 20)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                w["inbuf"] += data
                msgs, bad = read_frames(w["inbuf"])
                try:
                    for msg in msgs:
                        if not w["done"]:
                            from_rollout(fd, w, msg)
                except ValueError as e:
                    bad = bad or str(e)
                if bad is not None and not w["done"]:
                    w["bad"] = bad
                if not data or w["done"] or w["bad"] is not None:
                    end(fd)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child_main(int(sys.argv[2]), int(sys.argv[3]))
