"""
sandbox.py: run one harness file over many rollouts, each in a locked-down process of its own.

A harness is model- or agent-written Python. The parent process owns the model, the data,
the tools and the verifier; the child gets only the harness's control flow. The child is a
router that runs no harness code: it forks one process per rollout, and each of those imports
the harness afresh and runs it once, so no state of one rollout (globals, modules, threads,
files, what a tool answered) reaches another, and mean@k is a mean of independent tries. Every
llm() and tools.<name>() call in the harness is a JSON message over a pipe to the parent,
which validates it, runs the real thing and answers. So the parent can batch llm() calls of
all concurrent rollouts into one model call and record the exact prompt/completion token
ids, and a harness cannot see the reference answers, change the sampling or skip the model.

    run_rollouts(source, jobs, llm_batch, make_tools_for, ...) -> one record per job
    run_python(code, ...) -> {"stdout", "error"}   # model-written code, e.g. a math tool

The layers, from the inside out (all applied in every mode unless noted):
- Audit hook (sys.addaudithook, Python, in the child): file opens and listings only inside
  scratch (read-write) and the stdlib (read-only, no site-packages); blocks sockets, ctypes,
  fork/exec/spawn/kill, sub-interpreters, sqlite extensions, symlinks, chmod, gc
  introspection, sys.settrace. Its inputs are immutable default arguments (see
  sandbox_child._make_audit_hook), so nothing a harness can reach reprograms it; it can still
  be fooled.
- Landlock (kernel, unprivileged, Linux >= 5.13, landlock.py; applied in the forked child
  before exec, after the mounts, before the uid drop, inherited by everything it execs): the
  child may READ only the interpreter, its loader and system libraries, libpython and the
  stdlib (not site-packages; not /proc, /sys, /tmp, /etc beyond ld.so.cache, the repo, the
  data wherever WHALE_DATA points, other checkouts, $HOME), READ+WRITE only its scratch dir
  and /dev/null, EXECUTE only the interpreter and its loader; whatever code opens the file
  (sqlite, any C library). ABI >= 4: no TCP bind/connect; ABI >= 6: no signals or abstract
  unix sockets outside the sandbox. Where Landlock is unavailable the run prints one
  warning line and goes on without it (as it does with WHALE_SANDBOX_NO_LANDLOCK=1, which
  the tests set to show what Landlock alone stops).
- Namespaces: as root, new network and mount namespaces (no network at all; the repo, the
  parent's cwd and any non-world-searchable parent of the interpreter such as /root are
  covered by empty tmpfs mounts, the interpreter re-bound read-only; scratch is a 64 MB
  tmpfs). As a normal user, a new user+network namespace where the kernel allows it.
- nobody: as root the child drops to uid/gid 65534 when it can (with namespaces, or when
  nobody can reach the interpreter), so file permissions and RLIMIT_NPROC bind; a normal
  user's child runs as that user. PR_SET_NO_NEW_PRIVS: no setuid binary gives privileges.
- One process per rollout (sandbox_child._route): forked from the router before any harness
  code runs, it closes every descriptor but its own socket, makes scratch/r<k> its cwd and its
  only writable place (the audit hook's), then locks down; the router decodes and checks each
  of its frames (a call or done of its own rollout, nothing else), so garbage, a forged rid or
  a crash costs that rollout alone. At its deadline the parent has the router kill it.
- rlimits: RLIMIT_NPROC=0 in every rollout process, RLIMIT_CPU, RLIMIT_AS (memory, per
  process; all rollout processes together are held to mem_mb by the parent, watch_memory),
  RLIMIT_FSIZE, RLIMIT_NOFILE, no core dumps; the environment is scrubbed, stdin/stdout/
  stderr are /dev/null (print() goes to a capped per-rollout buffer), cwd is scratch/r<k>.
- Parent checks (this process): 4 MB frames, decode errors, an iterative depth check
  (MAX_DEPTH) right after decoding and before anything recursive, strict validation of every
  message; text that is not valid Unicode (lone surrogates, valid_text) refused in prompts and
  tool calls and kept as U+FFFD in output, errors and answers; llm() calls capped in
  characters, messages and (rollout.py) prompt tokens before any prefill; call budgets;
  per-rollout deadlines that charge the harness's own time, its tools and its share of every
  model batch; a batch timeout; SIGKILL to the child's process group when the batch ends,
  PR_SET_PDEATHSIG. A dead, hung or garbling child costs that batch its results ("crash" /
  "timeout" / "protocol" per unfinished rollout), never the run.
  Scratch dirs are named with the parent's pid, so that a parent killed with SIGKILL leaves one
  that the next run removes (clean_dead_scratch).

Which layer stops what (strongest first; hostile/ holds a harness for every row, the file
ones with the audit hook defeated first, see read_data_copy.py):

    attack                                          stopped by
    read data/answers, other checkouts, /proc,      Landlock; nobody's permissions (not for
      /tmp, $HOME outside scratch (hook defeated)     world-readable files); tmpfs covers (root)
    write or create files outside scratch, also     Landlock; nobody's permissions (not for
      from C (sqlite ATTACH, VACUUM INTO)             /tmp); audit hook (Python-level opens)
    rewrite the hook's tables/helpers/frame         audit hook (immutable defaults)
    network                                         network namespace; Landlock (TCP); hook
    new processes, threads                          RLIMIT_NPROC (not as root); audit hook
    share state with another rollout (globals,      a process per rollout (fresh import); the
      files, tool answers), forge its messages        hook (own dir only); the router's checks
    signal other processes                          Landlock scope; nobody; audit hook
    memory, CPU, disk, fds                          rlimits; 64 MB tmpfs scratch (namespaces)
    hang, sleep, llm()/tool flood                   parent: deadline incl. model and tool time
    huge-token prompt, 100k messages                parent: message cap, token cap (before prefill)
    deep/huge/garbled/forged messages               parent: frame cap, depth check, validation
    lone surrogates (tokenizer, file, log crash)    parent: valid_text at every boundary
    see answers, fake scores, change sampling       design: they never leave the parent

What it does NOT protect against (it is not a security boundary for hostile humans):
- The audit hook is Python in the same interpreter as the harness. Known ways past it: C
  code that opens files itself (sqlite ATTACH: hostile/read_data_copy.py), crafted bytecode,
  CPython bugs. (The cwd race, a second thread moving the cwd between the hook's check and
  the kernel's, needs a thread: a rollout process has one and may start none.) Behind it:
  Landlock, nobody, namespaces.
- Without Landlock (an old kernel, Landlock disabled at boot or blocked by a seccomp
  filter): once the hook is defeated, files readable by the child's user outside the tmpfs
  covers are readable (world-readable data copies included; as a root child, everything).
- Landlock (ABI <= 7) does not cover file metadata (stat, access, readlink: any path's
  existence and size are visible), chdir, UDP or raw sockets, or connecting to a path-based
  unix socket; they are left to the hook, the network namespace and file permissions. As
  root without namespaces and unable to become nobody the child stays root: then only the
  hook guards UDP/raw sockets and unix sockets, and RLIMIT_NPROC does not bind.
- CPU contention with the parent and other processes, side channels, kernel exploits,
  disk use outside the 64 MB tmpfs when namespaces are unavailable (RLIMIT_FSIZE caps single
  files only). pathlib objects are refused as open() arguments (pass str).
- The rollout processes of a batch run as one user in one Landlock domain, and Landlock
  grants the whole scratch: a rollout that gets past the hook (sqlite ATTACH) can read or
  write a file a concurrent rollout keeps in its own directory, and signal or trace it where
  the kernel lets one process of a user do so to another. Only the hook keeps them apart.
- The batch's memory is watched, not capped: watch_memory adds up the rollout processes every
  WATCH_S, so a burst can pass mem_mb for that long (each process stays under RLIMIT_AS).
- A model batch, once started, is never cut short: a flood overruns its deadline by the
  batch it is in.

Deliberately left out: seccomp filters, cgroups, a pid namespace. Per-rollout processes cost
little: a fork of the small router plus one import of the harness (tools/bench.py --only
isolation); the llm() calls of all of them still go out as one batch.

The child runs sandbox_child.py (the protocol, the lock-down, the audit hook, the router and
the rollout processes), read from an inherited descriptor (_BOOT), as __main__ with --child; this file is the
parent: it spawns the child, pumps its messages and answers its calls. The steps between fork
and exec (namespaces, tmpfs covers, Landlock, nobody, rlimits) are isolation.py's.
"""
import json
import os
import resource
import signal
import time

from jail import isolation

# the protocol and its caps, shared with the child (valid_text: the text rule every module uses)
from jail.sandbox_child import (ANSWER_CHARS, ERROR_CHARS, MAX_MSG, STDOUT_CHARS, frame, last_line, read_frames,
                                valid_text)

MAX_PROMPT_CHARS = 262_144   # all message contents of one llm() call
MAX_MESSAGES = 256           # messages in one llm() call (each adds chat-template tokens of its own)
MAX_SAMPLES = 16             # replies one llm(..., n=) call may ask for (each counts as a call)
MAX_TOOL_ARGS = 65_536       # bytes of JSON arguments of one tool call
RESULT_CHARS = 2_000         # of a tool result, as recorded (the harness gets all of it)
WATCH_S = 0.25               # how often the memory of a batch's rollout processes is added up
FLUSH_S = 0.05               # pending llm() calls go out once no new one came for this long ...
MAX_GATHER_S = 0.5           # ... or the oldest has waited this long (a rollout busy with tools)
STARTUP_S = 30.0             # for the interpreter to start and say hello
_TOOL_DEADLINE = [None]      # while a harness's tool call runs: the monotonic time its rollout's deadline falls
OVERHEAD_MB = 128            # address space of the interpreter itself, on top of mem_mb
FSIZE_MB = 16                # largest file the child may write
NOFILE = 64
ROLES = ("system", "user", "assistant")
SCRATCH_PREFIX = "whale_sbx_"  # + <pid of the parent>-<random>, in the temp dir (see clean_dead_scratch)


# ----------------------------------------------------------------------------------------
# Parent side: spawning the child, the message pump, run_rollouts, run_python.

class _Gone(Exception):
    """The child died or closed its pipe."""


class _Bad(Exception):
    """The child broke the protocol (bad length, bad JSON, unknown rollout ...)."""


# The child's first code: read sandbox_child.py from the inherited descriptor and run it as __main__.
_BOOT = "import os, sys; exec(compile(os.fdopen(int(sys.argv[4]), 'rb').read(), 'sandbox_child.py', 'exec'))"


class _Child:
    """The parent's handle on one sandbox process: spawn, framed JSON both ways, kill."""

    def __init__(self, init, *, mem_mb, cpu_s, nofile=NOFILE):
        import subprocess, tempfile  # parent only
        first = frame(init)  # before spawning: a task that is not JSON fails here, leaving nothing behind
        plan = isolation.plan()
        # The owner's pid in the name: a parent killed with SIGKILL cannot remove its scratch, and
        # clean_dead_scratch() removes it on the next start once that pid is gone.
        self.scratch = os.path.realpath(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        covers = isolation.covers(plan, self.scratch)
        limits = [(resource.RLIMIT_CPU, max(1, int(cpu_s))),
                  (resource.RLIMIT_FSIZE, FSIZE_MB << 20),
                  (resource.RLIMIT_NOFILE, nofile),
                  (resource.RLIMIT_CORE, 0),
                  (resource.RLIMIT_AS, int(mem_mb + OVERHEAD_MB) << 20)]
        if plan["root"]:
            os.chown(self.scratch, isolation.NOBODY, isolation.NOBODY)  # used when there is no tmpfs scratch
        c2p_r, c2p_w = os.pipe()
        p2c_r, p2c_w = os.pipe()
        # The child's code goes in as an open file: Landlock (and the tmpfs over the repo) keep
        # it from opening sandbox.py by any path, /proc/self/fd/N included.
        script = os.open(os.path.join(os.path.dirname(os.path.realpath(__file__)), "sandbox_child.py"), os.O_RDONLY)
        landlock_abi = isolation.landlock_abi(plan)
        if os.environ.get("WHALE_SANDBOX_NO_LANDLOCK"):  # for tests that show what Landlock stops
            isolation.warn_once("sandbox", "WHALE_SANDBOX_NO_LANDLOCK is set: the kernel file layer (Landlock) is "
                                "off; files outside scratch are protected only by the audit hook and file permissions")
        elif not landlock_abi:
            isolation.warn_once("sandbox", f"{plan['landlock_off']}: the kernel file layer is off; files outside "
                                "scratch are protected only by the audit hook and file permissions")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "MALLOC_ARENA_MAX": "2", "HOME": self.scratch, "TMPDIR": self.scratch}
        # -s -S: no site-packages; -B: no .pyc writes; -P: no script dir on sys.path.
        # (Not -I: it would also ignore PYTHONHASHSEED, and set iteration order should not
        # differ between runs of the same harness.)
        argv = [plan["exe"], "-s", "-S", "-B", "-P", "-c", _BOOT, "--child", str(p2c_r), str(c2p_w), str(script)]
        stderr = None if os.environ.get("WHALE_SANDBOX_STDERR") else subprocess.DEVNULL
        try:
            for attempt in (0, 1):
                p = dict(plan, limits=limits, covers=covers, scratch=self.scratch, ppid=os.getpid(),
                         landlock_abi=landlock_abi)
                try:
                    self.proc = subprocess.Popen(
                        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                        cwd=self.scratch, env=env, pass_fds=(p2c_r, c2p_w, script),
                        start_new_session=True, preexec_fn=lambda: isolation.preexec(p))
                    break
                except (OSError, subprocess.SubprocessError):
                    if attempt or not plan["namespaces"]:
                        raise
                    plan["namespaces"] = False  # e.g. a container without CAP_SYS_ADMIN
        except BaseException:
            for fd in (c2p_r, c2p_w, p2c_r, p2c_w, script):
                os.close(fd)
            os.rmdir(self.scratch)
            raise
        for fd in (c2p_w, p2c_r, script):
            os.close(fd)
        self.rfd, self.wfd = c2p_r, p2c_w
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)  # a child that stops reading must not block us
        self.inbuf, self.outbuf, self.broken = bytearray(), bytearray(first), None

    def send(self, msg):
        self.outbuf += frame(msg)

    def write_out(self):
        """Write as much of the queued output as the pipe takes now, without blocking."""
        try:
            del self.outbuf[:os.write(self.wfd, self.outbuf)]
        except BlockingIOError:
            pass
        except OSError as e:  # EPIPE: it stopped reading; first take what it already sent
            self.broken, self.outbuf = f"closed its end of the pipe ({e.strerror})", bytearray()

    def pump(self, timeout):
        """Write what we can, wait up to timeout for input, return the complete messages."""
        import select  # parent only
        poller = select.poll()
        poller.register(self.rfd, select.POLLIN)
        if self.outbuf:
            poller.register(self.wfd, select.POLLOUT)
        events = dict(poller.poll(max(0.0, timeout) * 1000))
        if events.get(self.wfd):
            self.write_out()
        if self.rfd in events:
            try:
                data = os.read(self.rfd, 1 << 20)
            except BlockingIOError:
                data = None
            if data == b"":
                raise _Gone(self._describe_exit("closed its pipe"))
            if data:
                self.inbuf += data
        msgs, bad = read_frames(self.inbuf)
        if bad is not None:
            raise _Bad(bad)
        if self.broken and not msgs:
            raise _Gone(self._describe_exit(self.broken))
        return msgs

    def _describe_exit(self, what):
        try:
            rc = self.proc.wait(timeout=1.0)
        except Exception:
            return f"sandbox process {what} but is still running"
        if rc < 0:
            return f"sandbox process killed by {signal.Signals(-rc).name}"
        return f"sandbox process exited with code {rc}"

    def close(self):
        import shutil  # parent only
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()
        for fd in (self.rfd, self.wfd):
            os.close(fd)
        shutil.rmtree(self.scratch, ignore_errors=True)


def clean_dead_scratch():
    """Remove the scratch directories of sandbox parents that died without cleaning up (kill -9,
    a power cut): /tmp/whale_sbx_<pid>-* whose <pid> no longer exists. Only those: a directory
    of a live process (another run on this machine), one named the old way without a pid (its
    random part never has a "-", so it cannot pass for a pid), or one whose pid was reused by a
    new process is left alone. whale.py calls it on every start
    and resume. Returns the paths removed."""
    import re, shutil, tempfile  # parent only
    removed = []
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        m = re.fullmatch(re.escape(SCRATCH_PREFIX) + r"(\d+)-\w+", name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or alive but not ours: EPERM)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(os.path.join(root, name))
    return removed


def _call_seed(seed, k):
    """Seed of the k-th llm() call of a rollout whose job seed is `seed`: stable across runs."""
    import hashlib  # parent only
    return int.from_bytes(hashlib.sha256(f"{seed}:{k}".encode()).digest()[:4], "big")


def _llm_request(msg, max_llm_tokens):
    """Validate one llm() call from the child -> (messages, max_tokens, stop, n); ValueError if bad.
    n: None for one reply (a str), else that many replies to the same prompt (a list of str)."""
    messages = msg.get("messages")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise ValueError(f"more than {MAX_MESSAGES} messages")
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ROLES
            and isinstance(m["content"], str) for m in messages)):
        raise ValueError("messages must be a str or a non-empty list of "
                         "{'role': 'system'|'user'|'assistant', 'content': str}")
    if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
        raise ValueError(f"prompt longer than {MAX_PROMPT_CHARS} characters")
    for k, m in enumerate(messages):  # the tokenizer raises on a lone surrogate: refused here instead
        valid_text(m["content"], f"message {k} ({m['role']})")
    max_tokens = msg.get("max_tokens")
    if type(max_tokens) is not int or max_tokens < 1:
        raise ValueError("max_tokens must be a positive int")
    stop = msg.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= 16
            and all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop)):
        raise ValueError("stop must be None, a str or a list of at most 16 non-empty str")
    for s in stop:
        valid_text(s, "a stop string")
    n = msg.get("n")
    if not (n is None or (type(n) is int and 1 <= n <= MAX_SAMPLES)):
        raise ValueError(f"n must be None or an int from 1 to {MAX_SAMPLES}")
    return messages, min(max_tokens, max_llm_tokens), stop, n


def run_rollouts(source, jobs, llm_batch, make_tools_for, *, rollout_timeout=60.0, batch_timeout=900.0,
                 mem_mb=2048, max_llm_tokens=512, concurrency=None, cpu_s=None,
                 max_llm_calls=64, max_tool_calls=256):
    """Run harness `source` once per job in one sandbox process; see the module docstring.

    jobs: [{"rid", "task", "seed"}]. llm_batch(calls) -> [{"text", "prompt_ids",
    "completion_ids", "finish"} or {"error": str}] for calls [{"rid", "messages", "max_tokens",
    "stop", "seed"}]; all pending llm() calls of the live rollouts go out as one batch, and an
    {"error"} output refuses that one call (it raises ToolError in the harness; e.g. a prompt
    over the model's context). make_tools_for(rid) -> {name: fn} runs in this process.
    concurrency: rollout processes alive at once (None: all jobs at once). cpu_s: RLIMIT_CPU of
    the child and of each rollout process (None: batch_timeout + 10). mem_mb: the address space of
    each rollout process, and the memory all of them may hold together beyond the router
    (watch_memory). Returns one record per job, in order; "charged_s" is
    what the rollout was charged against rollout_timeout, "model_s" the model shares in it.

    What counts against rollout_timeout: the harness's own time, the tools it called, and its
    share of every llm batch it was in (the batch's seconds / its rows). Shares, not whole
    batches: 512 legitimate rollouts sampled together each pay 1/512 of the batch they shared,
    so our real batch sizes never time out, while a rollout that floods llm() pays for all the
    model time it alone caused, so in n rollouts a flood costs at most n * rollout_timeout of
    model time (the same as n slow harnesses), and a flooding rollout stops within one batch of
    its deadline (the batch it is in when it passes it; its process is then killed). A batch
    itself is never cut short. batch_timeout counts the harness's own time in this child only
    (model time is bounded per rollout as above and by max_llm_calls / max_tool_calls).

    In the harness, a refused or failed llm()/tools.<name>() call raises ToolError (the
    sandbox defines that name in the harness module); llm() takes exactly (messages,
    max_tokens=256, stop=None, n=None): sampling settings belong to the parent. n=k asks for k
    replies to one prompt, sampled in the same batch with seeds of their own (one prefill, one
    shared prompt cache: self-consistency at far less than k calls' cost); each is a call of
    the trace and of max_llm_calls, and the harness gets a list of k texts.
    """
    n = len(jobs)
    recs = [{"rid": j["rid"], "answer": None, "status": None, "error": None, "calls": [],
             "tool_calls": [], "stdout": "", "wall_s": 0.0, "charged_s": 0.0, "model_s": 0.0} for j in jobs]
    if n == 0:
        return recs
    try:  # (the child would die writing it to its harness.py)
        valid_text(source, "the harness source")
    except ValueError as e:
        for r in recs:
            r.update(status="error", error=str(e))
        return recs
    tools = [make_tools_for(j["rid"]) for j in jobs]
    processes = max(1, min(n, concurrency or n))  # rollout processes alive at once
    init = {"t": "init", "mode": "rollouts", "source": source, "processes": processes,
            "jobs": [{"task": j["task"], "tools": sorted(k for k in t if not k.startswith("_"))}
                     for j, t in zip(jobs, tools)]}

    # The harness clock: wall time minus the time this process spent in llm_batch and tools.
    busy, t_start = 0.0, time.monotonic()
    clock = lambda: time.monotonic() - t_start - busy
    # Per rollout: used = seconds charged so far (own time, its tools, its model shares);
    # run_since = clock when it last started running (None while it waits for a reply).
    st = [{"used": 0.0, "model": 0.0, "run_since": None, "t0": None, "n_llm": 0, "n_tool": 0, "call": None,
           "freed": False} for _ in range(n)]
    live, waiting, queued = set(), {}, list(range(n))[::-1]  # waiting: i -> clock at request
    last_llm = [0.0]  # clock of the newest llm() call
    unfinished = n

    def start(i):
        live.add(i)
        st[i]["run_since"], st[i]["t0"] = clock(), time.monotonic()

    def finish(i, status, error=None, answer=None, stdout=""):
        nonlocal unfinished
        if status == "timeout" and i in live:
            child.send({"t": "kill", "rid": i})  # its process goes; its place goes to the next job
        live.discard(i)
        waiting.pop(i, None)
        r = recs[i]
        # What the child said is kept as a record: lone surrogates become U+FFFD (valid_text).
        r["status"], r["error"], r["answer"], r["stdout"] = (status, *(valid_text(x, replace=True)
                                                                       for x in (error, answer, stdout)))
        r["wall_s"] = time.monotonic() - st[i]["t0"] if st[i]["t0"] else 0.0
        r["charged_s"] = st[i]["used"] + (clock() - st[i]["run_since"] if st[i]["run_since"] is not None else 0.0)
        r["model_s"] = st[i]["model"]
        unfinished -= 1

    def finish_all(status, error):
        for i in range(n):
            if recs[i]["status"] is None:
                finish(i, status, error)

    def reply(i, ok, value):
        if st[i]["used"] > rollout_timeout:  # its tools or model share took it past the deadline
            finish(i, "timeout", f"rollout timeout ({rollout_timeout} s, model and tool time included)")
            ok, value = False, "rollout timed out"  # (its process is being killed)
        child.send({"t": "reply", "rid": i, "ok": ok, ("value" if ok else "error"): value})
        st[i]["run_since"] = clock() if recs[i]["status"] is None else None

    def on_tool(i, msg):
        nonlocal busy
        name, args, kwargs = msg.get("name"), msg.get("args"), msg.get("kwargs")
        if not (isinstance(name, str) and isinstance(args, list) and isinstance(kwargs, dict)):
            raise _Bad("malformed tool call")
        st[i]["n_tool"] += 1  # every attempt counts, so a loop of bad calls ends too
        if st[i]["n_tool"] > max_tool_calls:
            return reply(i, False, f"tool call budget ({max_tool_calls}) exhausted")  # not recorded
        rec = {"name": name, "args": args, "kwargs": kwargs, "result": None, "error": None}
        fn = None if name.startswith("_") else tools[i].get(name)
        value = None
        call = [name, args, kwargs]
        try:  # (ensure_ascii=False: a lone surrogate anywhere in the call, keys too, stays one)
            valid_text(json.dumps(call, ensure_ascii=False), "the tool call")
            refused = None if len(json.dumps(call)) <= MAX_TOOL_ARGS else f"tool call over {MAX_TOOL_ARGS} bytes"
        except ValueError as e:  # no tool, trace or file gets text that is not valid Unicode
            refused = str(e)
        if refused:
            rec.update(name=valid_text(name[:100], replace=True), args=None, kwargs=None, error=refused)
        elif fn is None:
            rec["error"] = f"unknown tool {name!r}"
        else:
            t = time.monotonic()
            _TOOL_DEADLINE[0] = t + max(0.0, rollout_timeout - st[i]["used"])  # see tool_deadline()
            try:
                value = fn(*args, **kwargs)
            except Exception as e:
                rec["error"] = last_line(e)
            finally:
                _TOOL_DEADLINE[0] = None
            t = time.monotonic() - t
            busy += t
            st[i]["used"] += t  # only this rollout waited for it
        if rec["error"] is None:
            try:
                try:
                    text = value if isinstance(value, str) else json.dumps(value)
                except (TypeError, ValueError):
                    value = text = str(value)
                if len(text) > MAX_MSG // 2:
                    rec["error"] = "tool result too large"
                rec["result"] = valid_text(text[:RESULT_CHARS], replace=True)
            except Exception as e:  # e.g. RecursionError on absurdly nested data
                rec["error"] = f"tool result not serialisable: {type(e).__name__}"
        recs[i]["tool_calls"].append(rec)
        reply(i, rec["error"] is None, value if rec["error"] is None else rec["error"])

    def on_llm(i, msg):
        st[i]["n_llm"] += 1  # every attempt counts, valid or not
        try:
            call = _llm_request(msg, max_llm_tokens)
            if st[i]["n_llm"] + (call[3] or 1) - 1 > max_llm_calls:  # n replies are n calls
                raise ValueError(f"llm call budget ({max_llm_calls}) exhausted")
            st[i]["n_llm"] += (call[3] or 1) - 1
            st[i]["call"] = call
        except ValueError as e:
            return reply(i, False, f"llm: {e}")
        waiting[i] = clock()
        last_llm[0] = waiting[i]

    def flush():
        nonlocal busy
        order = sorted(waiting)
        calls, first = [], []  # a rollout's n replies are n consecutive calls, from first[k]
        for i in order:
            messages, max_tokens, stop, n_replies = st[i]["call"]
            first.append(len(calls))
            for j in range(n_replies or 1):  # seeds by call number, as n separate llm() calls get
                calls.append({"rid": jobs[i]["rid"], "messages": messages, "max_tokens": max_tokens, "stop": stop,
                              "seed": _call_seed(jobs[i].get("seed", 0), len(recs[i]["calls"]) + j)})
        t = time.monotonic()
        outs = llm_batch(calls)
        t = time.monotonic() - t
        busy += t
        assert len(outs) == len(calls), "llm_batch must answer every call"
        for i, a, b in zip(order, first, first[1:] + [len(calls)]):
            del waiting[i]
            share = t * (b - a) / len(calls)  # its share of the batch (see the docstring)
            st[i]["used"] += share
            st[i]["model"] += share
            refused = [out["error"] for out in outs[a:b] if "error" in out]
            if refused:  # by the engine side, e.g. over the context: nothing sampled
                reply(i, False, f"llm: {refused[0]}"[:ERROR_CHARS])
                continue
            for call, out in zip(calls[a:b], outs[a:b]):
                recs[i]["calls"].append({"messages": call["messages"], "prompt_ids": out["prompt_ids"],
                                         "completion_ids": out["completion_ids"], "text": out["text"],
                                         "finish": out["finish"]})
            texts = [out["text"] for out in outs[a:b]]
            reply(i, True, texts if st[i]["call"][3] else texts[0])

    def on_message(msg):
        nonlocal phase, t_phase
        t = msg.get("t")
        if t == "hello" and phase == "hello":
            phase, t_phase = "load", clock()
            return
        if t == "ready" and phase == "load":
            if msg.get("error") is not None:
                return finish_all("error", str(msg["error"])[:ERROR_CHARS])
            phase = "run"
            for _ in range(processes):
                start(queued.pop())
            return
        i = msg.get("rid")
        if phase != "run" or type(i) is not int or not 0 <= i < n or t not in ("call", "done"):
            raise _Bad(f"unexpected message {t[:40] if isinstance(t, str) else type(t).__name__!r}")
        finished = recs[i]["status"] is not None  # e.g. timed out: what it says now is ignored
        if not finished and (i not in live or i in waiting):
            raise _Bad("message for a rollout that is not running")
        if t == "done":  # from the rollout ("ok", "error") or, for a rollout process that died or
            # broke the protocol, from the child's router ("crash", "protocol", with its pid)
            status, answer, error, stdout = (msg.get(k) for k in ("status", "answer", "error", "stdout"))
            if status not in ("ok", "error", "crash", "protocol") or not isinstance(stdout, str) or not all(
                    x is None or isinstance(x, str) for x in (answer, error)):
                raise _Bad("malformed done message")
            if type(msg.get("pid")) is int and msg["pid"] in memory_kills:
                error = f"rollout process killed: the batch's rollouts held over {mem_mb} MB together"
            if not finished:
                finish(i, status, error if error is None else error[:ERROR_CHARS],
                       answer if answer is None else answer[:ANSWER_CHARS], stdout[:STDOUT_CHARS])
            if st[i]["t0"] is not None and not st[i]["freed"]:
                st[i]["freed"] = True  # its place goes to the next job (the router starts it too)
                if queued:
                    start(queued.pop())
            return
        if finished:  # a call from a timed-out rollout, sent before the router killed it: refused
            return child.send({"t": "reply", "rid": i, "ok": False, "error": "rollout timed out"})
        st[i]["used"] += clock() - st[i]["run_since"]
        st[i]["run_since"] = None
        kind = msg.get("kind")
        if kind == "tool":
            on_tool(i, msg)
        elif kind == "llm":
            on_llm(i, msg)
        else:
            raise _Bad("unknown call kind")

    # Each rollout process may take mem_mb of address space, and all of them together mem_mb
    # more than the router (watch_memory); the router holds a socket per rollout process.
    child = _Child(init, mem_mb=mem_mb, nofile=NOFILE + processes,
                   cpu_s=cpu_s if cpu_s is not None else batch_timeout + 10)
    phase, t_phase = "hello", clock()
    last_scan, last_watch, memory_kills = 0.0, 0.0, set()
    try:
        while unfinished:
            now = clock()
            if phase == "hello" and now - t_phase > STARTUP_S:
                finish_all("crash", f"sandbox did not start within {STARTUP_S:.0f} s")
            if phase == "load" and now - t_phase > rollout_timeout:
                finish_all("timeout", f"harness module took longer than {rollout_timeout} s to load")
            if now > batch_timeout:
                finish_all("timeout", f"batch timeout ({batch_timeout} s)")
            if phase == "run" and now - last_scan > 0.02:
                last_scan = now
                for i in list(live):
                    if i not in waiting and st[i]["used"] + now - st[i]["run_since"] > rollout_timeout:
                        finish(i, "timeout", f"rollout timeout ({rollout_timeout} s)")
            if phase == "run" and now - last_watch > WATCH_S:
                last_watch = now
                memory_kills |= watch_memory(child.proc.pid, mem_mb)
            if not unfinished:
                break
            # One batch when every running rollout waits for the model; a rollout that is slow,
            # hung or busy with tools holds the others back by FLUSH_S (at most MAX_GATHER_S).
            if waiting and (len(waiting) == len(live) or now - last_llm[0] >= FLUSH_S
                            or now - next(iter(waiting.values())) >= MAX_GATHER_S):
                if child.outbuf:
                    child.write_out()  # let queued tool replies out before a long model call
                flush()
                continue
            try:
                wait = 0.05 if phase == "run" else 0.25
                if waiting:
                    wait = min(wait, FLUSH_S - (now - last_llm[0]),
                               MAX_GATHER_S - (now - next(iter(waiting.values()))))
                for msg in child.pump(wait):
                    try:
                        on_message(msg)
                    except _Bad:
                        raise
                    except Exception as e:  # whatever the child sent, it must not raise in here
                        raise _Bad(f"{type(e).__name__} while handling a message")
                    if not unfinished:
                        break
            except _Gone as e:
                finish_all("crash", str(e))
            except _Bad as e:
                finish_all("protocol", f"protocol violation: {e}")
    finally:
        child.close()
    return recs


def watch_memory(router, mem_mb):
    """The memory of a batch's rollout processes together: each may take mem_mb of address space
    (RLIMIT_AS), so many of them could take far more than the machine has. Every WATCH_S the
    parent adds up what each rollout process holds beyond the router it was forked from (its
    private resident pages, from /proc/<pid>/statm) and, while the sum is over mem_mb, kills the
    largest. Returns the pids it killed (the router reports each as a crash)."""
    page = os.sysconf("SC_PAGE_SIZE")

    def private(pid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                size, resident, shared = (int(x) for x in f.read().split()[:3])
            return (resident - shared) * page
        except (OSError, ValueError):
            return 0
    try:
        with open(f"/proc/{router}/task/{router}/children") as f:
            pids = [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return set()
    base = private(router)
    held = sorted(((max(0, private(pid) - base), pid) for pid in pids), reverse=True)
    total, killed = sum(h for h, _ in held), set()
    for h, pid in held:
        if total <= mem_mb << 20:
            break
        try:  # by a pidfd, checked to still be the router's child: never a pid reused meanwhile
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == router:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    killed.add(pid)
                    total -= h
        except (OSError, ValueError, IndexError):
            pass
        finally:
            os.close(fd)
    return killed


def tool_deadline():
    """While a tool call of run_rollouts runs (in this process): the monotonic time at which its
    rollout's deadline falls, else None. A tool that can wait (run_python) stops by then, so a
    tool call's time counts against its rollout and cannot outlast it."""
    return _TOOL_DEADLINE[0]


def run_python(code, timeout_s=5.0, mem_mb=512, max_output=4000):
    """Run model-written Python (e.g. a math domain's python tool) in a fresh sandbox process
    with the same limits and audit hook. Returns {"stdout": str, "error": str | None}. It ends
    by timeout_s of the code's own time, and within a rollout's tool call by that rollout's
    deadline (tool_deadline()), whichever comes first; nothing the code sends extends either
    (one hello, then one done: any other frame is a protocol violation)."""
    t0 = time.monotonic()
    deadline = tool_deadline()
    end = t0 + STARTUP_S + timeout_s if deadline is None else min(t0 + STARTUP_S + timeout_s, deadline)
    child = _Child({"t": "init", "mode": "python", "code": code, "max_output": max_output},
                   mem_mb=mem_mb, cpu_s=int(timeout_s) + 1)
    started = None
    try:
        while True:
            now = time.monotonic()
            if started is None and now - t0 > STARTUP_S:
                return {"stdout": "", "error": "crash: sandbox did not start"}
            if (started is not None and now - started > timeout_s) or now > end:
                past = deadline is not None and now >= deadline
                return {"stdout": "", "error": "TimeoutError: ran past its rollout's deadline" if past
                        else f"TimeoutError: ran longer than {timeout_s} s"}
            try:
                for msg in child.pump(min(0.05, max(0.0, end - now))):
                    if msg.get("t") == "hello" and started is None:
                        started = time.monotonic()
                    elif msg.get("t") == "done" and started is not None:
                        error = msg.get("error")
                        return {"stdout": valid_text(str(msg.get("stdout", ""))[:max_output], replace=True),
                                "error": None if error is None else valid_text(str(error)[:ERROR_CHARS], replace=True)}
                    else:
                        raise _Bad("unexpected message")
            except _Gone as e:
                return {"stdout": "", "error": f"crash: {e}"}
            except _Bad as e:
                return {"stdout": "", "error": f"protocol violation: {e}"}
    finally:
        child.close()
