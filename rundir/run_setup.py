"""
The command line checked, and the run directory opened: what whale.py does before its loop.

check_args finds every mistake a command line can hold (unknown names, missing files, flags
that contradict each other, a corrupt data file, a proposer endpoint that does not answer)
and raises UserError, which whale.py prints as one line with exit code 2, before anything is
written. parse_args turns the command line into whale.Args. open_run makes a new run directory with config.json, or reopens the one --resume
names with its saved settings (config.json and state.json checked by check_saved_run), refusing
a resume that would change what the run means; either way it holds the directory's lock for the
life of the process (lock_run: a second process on it stops with one line) and removes the
sandbox scratch dirs that killed runs left in /tmp (sandbox.clean_dead_scratch).
"""
import importlib
import importlib.util
import os
import re
from pathlib import Path

import domains
from rundir.exits import RunFinished, UserError  # one line and an exit code (whale.py's main says them)


def finished_summary(run) -> str:
    """What a finished run (summary.json) says of itself, in a few lines, read without touching it."""
    import json
    try:
        s = json.loads((Path(run) / "summary.json").read_text())
        cfg = json.loads((Path(run) / "config.json").read_text())
        return (f"{run} is finished; nothing was changed. {cfg.get('method')} on {cfg.get('domain')}, seed "
                f"{cfg.get('seed')}: {s['rollouts']} target rollouts in {s['seconds'] / 60:.1f} min\n"
                f"  test mean@{cfg.get('test_n', 8)} ({s['test_examples']} questions)  initial "
                f"{s['test_mean8_initial']:.3f} +- {s['test_mean8_initial_se']:.3f}   final {s['test_mean8_final']:.3f} "
                f"+- {s['test_mean8_final_se']:.3f}   gain {s['test_gain']:+.3f} +- {s['test_gain_se']:.3f}\n"
                f"  its page: {Path(run) / 'report.html'}; a new run of the same settings needs another --out")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--resume {run}: summary.json says the run is finished, but it cannot be read "
                        f"({type(e).__name__})") from None


def parse_args(args_class, argv=None, description="", presets=None):
    """The command line as an args_class (whale.Args): one flag per field, its help string from the
    field's metadata. A value comes from the command line, else from --preset NAME (presets[NAME],
    whale.PRESETS), else from the domain's own DEFAULTS (domains/<name>.py, e.g. chess's run size),
    else from args_class. argparse's own errors (--budget abc, --nosuch) become one UserError line."""
    import argparse
    import dataclasses

    def one_line(message):  # (argparse would print its whole usage and exit)
        raise UserError(f"{message} (python whale.py --help lists the flags)")
    by_domain = {d: domains.defaults(d) for d in domains.names()}
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter,
                                argument_default=argparse.SUPPRESS)  # only what the command line gives
    p.error = one_line
    for f in dataclasses.fields(args_class):
        shown = "; ".join([f"default: {f.default}"] * (f.default != "")
                          + [f"{d}: {v[f.name]}" for d, v in by_domain.items() if f.name in v])
        shown = f" [{shown}]" if shown else ""
        repeatable = f.name == "proposer_env"  # (the one flag that may be given several times)
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), help=f.metadata["help"] + shown,
                       action="append" if repeatable else "store")
    given = vars(p.parse_args(argv))
    a = {f.name: f.default for f in dataclasses.fields(args_class)}
    domain_defaults = by_domain.get(given.get("domain", a["domain"]), {})
    unknown = sorted(set(domain_defaults) - set(a))
    if unknown:  # a fork's typo in a domain file, not the user's: still one line
        raise UserError(f"domains/{given.get('domain', a['domain'])}.py: DEFAULTS names no flag: {', '.join(unknown)}")
    a.update(domain_defaults)
    presets = presets or {}
    if given.get("preset", "") not in ("", *presets):
        raise UserError(f"unknown --preset {given['preset']!r}; choose {' | '.join(presets) or 'none (there are none)'}")
    a.update(presets.get(given.get("preset", ""), {}))
    a.update(given)
    if "proposer_env" in given:
        a["proposer_env"] = ",".join(x.strip() for v in given["proposer_env"] for x in v.split(",") if x.strip())
    return args_class(**a)


# the flags that take one of a few words (--method and --domain: from METHODS and domains/)
CHOICES = {"test_split": ("test", "val"), "engine": ("hf", "vllm"), "chat_format": ("auto", "template", "plain"),
           "proposer": ("primitives", "self", "openai", "command"), "proposer_format": ("any", "file", "edit"),
           "proposer_ties": ("older", "newer"), "race": ("futility", "off"), "harness_length": ("iterations", "rollouts"),
           "proposer_merge": ("on", "off"), "two_by_two": ("on", "off"),
           "rollout_precision": ("fp32", "int8"), "sft_prompts": ("shared", "whole")}

# Settings added after runs were already made, whose default changes what a run does: a resumed run
# whose config.json predates one takes the value that keeps it doing what it did (a name a config
# lacks otherwise takes its default).
ADDED_LATER = {"confirm_examples": 0, "sft_prompts": "whole", "race": "off", "proposer_merge": "off",
               "two_by_two": "off"}


def check_args(a, methods, check_schedule):
    """Every mistake a command line can hold, found before a run directory exists. `a` is whale.Args.
    The method's own tables are passed in, never imported: methods is whale.METHODS (the checks read
    its fields), check_schedule(args, method, weight_pool_size) -> a reason or None is switch.check
    (weight_pool_size None: only whether --schedule parses)."""
    import dataclasses
    import math
    for f in dataclasses.fields(a):  # nan passes every range check below (nan < 0 is False); inf means nothing here
        if type(f.default) is float and not math.isfinite(getattr(a, f.name)):
            raise UserError(f"--{f.name.replace('_', '-')} must be a finite number, not {getattr(a, f.name)}")
    if a.out and not a.resume:  # the run directory must be one we can make (a file there, or above it, is not)
        there = next(p for p in (Path(a.out).absolute(), *Path(a.out).absolute().parents) if p.exists())
        if not there.is_dir():
            raise UserError(f"--out {a.out}: {there} is a file, not a directory")
    if a.method not in methods and a.method != "eval":
        raise UserError(f"unknown method {a.method!r}; choose one of {', '.join([*methods, 'eval'])}")
    method = methods.get(a.method)  # None: --method eval
    if a.domain not in domains.names():
        raise UserError(f"unknown domain {a.domain!r}; choose one of {', '.join(domains.names())}")
    for flag, words in CHOICES.items():
        if getattr(a, flag) not in words:
            raise UserError(f"unknown --{flag.replace('_', '-')} {getattr(a, flag)!r}; choose {' | '.join(words)}")
    if a.rollout_precision == "int8" and (a.device != "cpu" or a.engine != "hf"):  # int8.Int8Linear: CPU, HF model
        raise UserError(f"--rollout-precision int8 samples with the hf engine on the CPU only, not --device "
                        f"{a.device} --engine {a.engine} (use fp32 there)")
    if (a.max_memory < 0 and a.max_memory != -1) or (a.max_memory > 0 and a.engine != "hf"):  # (vLLM sizes its own cache)
        raise UserError(f"--max-memory {a.max_memory:g}: give a number of GB > 0 (0: no limit; -1: auto), "
                        f"with --engine hf")
    if a.engine == "vllm" and importlib.util.find_spec("vllm") is None:  # optional: not in requirements.txt
        raise UserError("--engine vllm needs the vllm package, which this Python lacks: install "
                        "requirements-vllm.txt in its own environment (README, 'On GPUs'), or vllm on a CUDA machine")
    if a.harness and not Path(a.harness).is_file():
        raise UserError(f"harness file {a.harness} does not exist")
    if a.harness:
        from harness_search import harness_source  # the same check every proposed candidate gets
        try:
            why = harness_source.static_check(Path(a.harness).read_text())
        except (OSError, UnicodeDecodeError) as e:
            why = f"cannot be read ({e})"
        if why:
            why = why.replace("syntax error", "does not parse")
            raise UserError(f"harness file {a.harness} is not a harness: {why}")
    from rundir import tracking  # --tracker: a known backend whose package is installed (imports none of them)
    if not any(n.strip() for n in a.tracker.split(",")):  # '' or ',' names nothing, not even none
        raise UserError(f"--tracker {a.tracker!r} names no tracker; choose none, {', '.join(tracking.BACKENDS)} "
                        "(or a comma list of them)")
    why = tracking.setup_error(a.tracker)
    if why:
        raise UserError(why)
    if a.proposer == "openai" and not (a.proposer_url or os.environ.get("WHALE_PROPOSER_URL")):
        raise UserError("--proposer openai needs --proposer-url (or WHALE_PROPOSER_URL)")
    check_proposer_flags(a)
    if a.proposer == "openai":  # a down endpoint is a mistake to report now, not after the first weight phase
        from harness_search import proposers
        why = proposers.endpoint_error(a.proposer_url or os.environ["WHALE_PROPOSER_URL"], a.proposer_model or None,
                                       os.environ.get(a.proposer_api_key_env))
        if why:
            raise UserError(why)
    if a.proposer == "command" and not a.proposer_command:
        raise UserError("--proposer command needs --proposer-command")
    if a.proposer_command:  # split now, as the jail's launcher will: a bad quote fails every call later
        import shlex
        try:
            shlex.split(a.proposer_command)
        except ValueError as e:
            raise UserError(f"--proposer-command {a.proposer_command!r} cannot be split into words ({e})") from None
    if a.proposer_hosts.strip() and not all(re.fullmatch(r"(\*\.)?[A-Za-z0-9.-]+", h.strip())
                                            for h in a.proposer_hosts.split(",") if h.strip()):
        raise UserError(f"--proposer-hosts {a.proposer_hosts!r}: a comma list of host names (or *.domain)")
    if a.seed < 0:  # (torch and numpy take seeds in [0, 2**32); the run name holds it)
        raise UserError(f"--seed must be >= 0, not {a.seed}")
    check_device(a.device)
    # counts: a zero batch would never finish, a negative "first N" would slice from the end ([:-1])
    for flags, least in ((("budget", "prompts_per_step", "group", "candidates", "test_n", "val_n", "harness_n",
                           "minibatch", "micro_batch", "max_tokens", "tp", "replay_steps", "sft_epochs"), 1),
                         (("test_limit", "val_limit", "test_subset", "harness_examples", "confirm_examples",
                           "train_layers", "max_kept_per_prompt", "top_k", "val_every"), 0)):
        for flag in flags:
            if getattr(a, flag) < least:
                raise UserError(f"--{flag.replace('_', '-')} must be {'> 0' if least else '>= 0'}, "
                                f"not {getattr(a, flag)}")
    if a.lr < 0 or a.clip <= 0 or not 0 <= a.accept_alpha <= 1:
        raise UserError("--lr must be >= 0, --clip > 0 and --accept-alpha in [0, 1]")
    why = check_schedule(a, method, None)
    if why:
        raise UserError(why)
    # contradictory flags: each would otherwise be silently ignored or run nothing
    if a.tp > 1 and a.engine != "vllm":
        raise UserError(f"--tp {a.tp} shards a vLLM engine; it needs --engine vllm")
    if a.micro_batch > a.minibatch:
        raise UserError(f"--micro-batch {a.micro_batch} is larger than --minibatch {a.minibatch}")
    for flag, value, needs in (("--proposer-url", a.proposer_url, "openai"), ("--proposer-model", a.proposer_model,
                               "openai"), ("--proposer-command", a.proposer_command, "command")):
        if value and a.proposer != needs:
            raise UserError(f"{flag} is only used by --proposer {needs}, not --proposer {a.proposer}")
    step = a.prompts_per_step * a.group
    if method and method.weights_until and a.budget < step:
        raise UserError(f"--budget {a.budget} buys no rollout step ({a.prompts_per_step} prompts x {a.group} = {step})")
    if a.temperature < 0 or not 0 < a.top_p <= 1:
        raise UserError("--temperature must be >= 0 and --top-p in (0, 1]")
    if a.test_limit and a.test_subset > a.test_limit:
        raise UserError(f"--test-subset {a.test_subset} is larger than --test-limit {a.test_limit}")
    domain = importlib.import_module(f"domains.{a.domain}")
    sizes = {}
    for split in ("weight", "harness", "val", "test"):  # a corrupt file fails here, before a run directory exists
        try:
            sizes[split] = len(domain.load_split(split))
        except Exception as e:
            source = getattr(domain, "DATA", domain.__file__)  # a domain without DATA generates its splits
            raise UserError(f"cannot load the {a.domain} {split} split from {source}: {type(e).__name__}: {e}")
    why = check_schedule(a, method, sizes["weight"])  # (e.g. an adaptive first phase longer than the budget)
    if why:
        raise UserError(why)

    check_model(a)


def check_model(a):
    """--model (on --resume: the checkpoint the run continues from, if it holds the whole model)
    loads as a causal LM with a tokenizer in --chat-format, with the layers --train-layers trains:
    config, tokenizer and an empty model, no weights read (models.check_model)."""
    from lm import models  # (imports torch: last, after the checks that need nothing)
    # (".checkpoint.old": a run killed between the two renames of a checkpoint; open_run puts it back)
    ckpts = [Path(a.resume) / d for d in ("checkpoint", ".checkpoint.old")] if a.resume else []
    name = next((str(c) for c in ckpts if (c / "state.json").exists() and (c / "model.safetensors").exists()),
                a.model)
    try:
        models.check_model(name, a.chat_format, a.train_layers)
    except models.ModelError as e:
        raise UserError(str(e))


def read_json_or_fail(path, what):
    """A run file as a dict, or one line saying which file is damaged."""
    import json
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{what}: {path} is missing or corrupt ({type(e).__name__}); "
                        f"the run cannot continue from it") from None
    if not isinstance(obj, dict):
        raise UserError(f"{what}: {path} is not a JSON object; the run cannot continue from it")
    return obj


# The keys a checkpoint's state.json must hold (run_dir.new_state writes them) and their types.
STATE_TYPES = {"phase": (str,), "done": (bool,), "cycle": (int,), "steps": (int,), "rollouts": (int,),
               "harness": (str,), "loader": (dict,), "phase_rewards": (list,), "evals": (list,),
               "best_val": (dict, type(None)), "pending_eval": (str, type(None)), "seconds": (int, float),
               "metrics_lines": (int,), "counters": (dict,)}


def check_saved_run(run, config, state, Args):
    """The two files a resume reads, checked in one place: config.json holds only whale.Args
    names, each with its flag's type (a name it lacks takes its default, or ADDED_LATER's value);
    state.json (None: no checkpoint yet) holds every key of STATE_TYPES with its type. A file edited or damaged from
    outside is one line here rather than a KeyError or TypeError deep in the loop. (Exact
    types: JSON true is not an int here.)"""
    import dataclasses
    kinds = {f.name: type(f.default) for f in dataclasses.fields(Args)}
    for k, v in config.items():
        if k not in kinds:
            raise UserError(f"--resume {run}: config.json has an unknown setting {k!r}")
        if type(v) not in ((int, float) if kinds[k] is float else (kinds[k],)):
            raise UserError(f"--resume {run}: config.json has {k}={v!r}, which is not of type {kinds[k].__name__}")
    for k, types in STATE_TYPES.items() if state is not None else ():
        if k not in state:
            raise UserError(f"--resume {run}: checkpoint/state.json has no {k!r}; the run cannot continue from it")
        if type(state[k]) not in types:
            raise UserError(f"--resume {run}: checkpoint/state.json has {k}={state[k]!r}, "
                            f"which is not of type {' or '.join(t.__name__ for t in types)}")
    if state is not None and state["phase"] not in ("A", "B"):
        raise UserError(f"--resume {run}: checkpoint/state.json has phase={state['phase']!r}, not 'A' or 'B'")
    loader = state["loader"] if state is not None else {}
    for k in ("pool_size", "seed", "epoch", "pos") if state is not None else ():  # rs_sft.new_loader's keys
        if type(loader.get(k)) is not int or loader[k] < 0:
            raise UserError(f"--resume {run}: checkpoint/state.json's loader has {k}={loader.get(k)!r}, not a "
                            "count; the run cannot continue from it (start it again with another --out)")


def check_device(device):
    """--device names a device this torch build has: cpu; cuda, cuda:N (a CUDA build with that GPU);
    mps. Checked before a run directory exists (torch is imported only for a device other than cpu)."""
    if device == "cpu":
        return
    if not re.fullmatch(r"cuda(:\d+)?|mps", device):
        raise UserError(f"unknown --device {device!r}; choose cpu, cuda, cuda:N or mps")
    import torch
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            why = "is a CPU build" if torch.version.cuda is None else "sees no CUDA device"
            raise UserError(f"--device {device}: this torch ({torch.__version__}) {why}; use --device cpu, or "
                            "install a CUDA build of torch on a machine with a GPU")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif not torch.backends.mps.is_available():
        raise UserError("--device mps: this torch has no MPS device here; use --device cpu")


def check_proposer_flags(a):
    """The phase-B proposer flags: values in range, and none given to a proposer that ignores it."""
    if a.proposer_max_tokens <= 0 or a.proposer_timeout < 0 or a.proposer_digest_chars < 1000:
        raise UserError("--proposer-max-tokens must be > 0, --proposer-timeout >= 0 and --proposer-digest-chars >= 1000")
    if not 0 <= a.proposer_budget_usd < float("inf"):  # nan fails too
        raise UserError(f"--proposer-budget-usd must be a number >= 0 (0 = no cap), not {a.proposer_budget_usd}")
    for name in filter(None, (x.strip() for x in a.proposer_env.split(","))):
        if not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise UserError(f"--proposer-env {name!r} is not an environment variable name")
        if name not in os.environ:
            raise UserError(f"--proposer-env {name}: that environment variable is not set")
    defaults = type(a)()
    for flag, users in (("proposer_max_tokens", ("self", "openai")), ("proposer_format", ("self", "openai")),
                        ("proposer_timeout", ("openai", "command")), ("proposer_api_key_env", ("openai",)),
                        ("proposer_digest_chars", ("self", "openai", "command")), ("proposer_env", ("command",)),
                        ("proposer_ties", ("primitives",)), ("proposer_merge", ("primitives",))):
        if getattr(a, flag) != getattr(defaults, flag) and a.proposer not in users:
            raise UserError(f"--{flag.replace('_', '-')} is only used by --proposer {' or '.join(users)}, "
                            f"not --proposer {a.proposer}")
    if a.proposer == "openai" and a.proposer_api_key_env != defaults.proposer_api_key_env \
            and not os.environ.get(a.proposer_api_key_env):
        raise UserError(f"--proposer-api-key-env {a.proposer_api_key_env}: that environment variable is not set")


HELD_LOCKS = []  # the open lock files of this process's run directories (see lock_run)


def lock_run(run: Path):
    """Hold the run directory for the life of this process, or stop with one line when another
    process holds it: two processes on one run directory (a second --resume of a live run, two
    grids writing one folder) would both write its checkpoint and metrics, and a resume first
    cleans up what it takes for a dead run's leftovers. The lock is flock(2) on the directory
    itself, so removing a file cannot admit a second process; the kernel releases it when the
    holder exits, SIGKILL included, so a killed run resumes at once. .lock only says who holds it."""
    import fcntl
    try:
        fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise UserError(f"cannot lock the run directory {run}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            pid = (run / ".lock").read_text(errors="replace").strip()[:32] or "?"
        except OSError:
            pid = "?"
        raise UserError(f"{run} is in use by another process (pid {pid}): wait for it or stop it, "
                        f"then `--resume {run}` continues the run") from None
    try:
        (run / ".lock").write_text(str(os.getpid()))
    except OSError:
        pass  # (it only names the holder in the message above)
    HELD_LOCKS.append(fd)


def open_run(a, methods, check_schedule):
    """A new run directory with config.json, or the one --resume names (with its saved args).
    `a` is whale.Args; its class gives the defaults a resumed run is compared against; methods and
    check_schedule are check_args'."""
    from rundir import run_dir as rd  # (imports torch: not needed to print --help or a flag error)
    from jail import sandbox
    Args = type(a)
    if a.resume:
        run = Path(a.resume)
        if not (run / "config.json").exists():
            raise UserError(f"{run} is not a run directory (no config.json)")
        if (run / "summary.json").exists():  # the run's last write: nothing is left to do, nothing is touched
            raise RunFinished(finished_summary(run))
        lock_run(run)  # before anything is read or cleaned up
        saved = read_json_or_fail(run / "config.json", f"--resume {run}")
        state = None
        if (run / "checkpoint").exists():  # written atomically; damaged only from outside
            state = read_json_or_fail(run / "checkpoint" / "state.json", f"--resume {run}")
        check_saved_run(run, saved, state, Args)
        for k in ("domain", "method", "seed"):
            if getattr(a, k) != getattr(Args(), k) and getattr(a, k) != saved.get(k):
                raise UserError(f"--resume {run}: that is a {k}={saved.get(k)} run, not {k}={getattr(a, k)}")
        default = {**vars(Args()), **domains.defaults(a.domain)}  # what parse_args gave the flags not given
        hardware = {k: getattr(a, k) for k in ("device", "engine", "tp", "tracker", "max_memory")  # (and its reporting)
                    if getattr(a, k) != default[k]}
        for k, v in vars(a).items():  # a resumed run keeps its settings (the hardware it runs on may change)
            if k not in ("resume", "out", "domain", "method", "seed", *hardware) and v != default[k] \
                    and v != saved.get(k):
                raise UserError(f"--resume {run}: --{k.replace('_', '-')} cannot change on resume "
                                f"(the run has {saved.get(k)!r})")
        untrusted = [k for k in STARTED_WITH if saved.get(k, default[k]) != default[k]
                     and getattr(a, k) != saved.get(k) and started_with(run).get(k) != saved.get(k)]
        if untrusted:
            raise UserError(f"--resume {run}: config.json sets " + ", ".join(f"--{k.replace('_', '-')} {saved[k]!r}"
                            for k in untrusted) + ", which this machine did not start the run with (an edited or "
                            "received run?); pass " + ("it" if len(untrusted) == 1 else "them") + " again to run it")
        a = Args(**{**ADDED_LATER, **saved, **hardware, "resume": str(run)})
        check_args(a, methods, check_schedule)
        record_started_with(run, a)
        rd.clean_partial(run)
        sandbox.clean_dead_scratch()  # what sandboxes of a killed run left in /tmp
        return run, a
    check_args(a, methods, check_schedule)
    run = Path(a.out or f"runs/{a.domain}-{a.method}-s{a.seed}")
    if (run / "config.json").exists():
        raise UserError(f"{run} already holds a run; pass --resume {run} or another --out")
    try:
        run.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. --out /proc/x, a read-only or full disk
        raise UserError(f"cannot make the run directory {run}: {e.strerror or e}") from None
    lock_run(run)
    if (run / "config.json").exists():  # another process made it while this one was starting
        raise UserError(f"{run} already holds a run; pass --resume {run} or another --out")
    try:
        rd.write_json(run / "config.json", vars(a))
    except OSError as e:
        raise UserError(f"cannot make the run directory {run}: {e.strerror or e}") from None
    record_started_with(run, a)
    sandbox.clean_dead_scratch()
    return run, a


# Settings that run a program or reach the network for the proposer. config.json is a file anyone
# can edit (or send): a resume takes these from it only when this machine's own record of the run
# (written when it started, in the user's cache, outside the run directory) says the same, or when
# the command line gives them again.
STARTED_WITH = ("proposer", "proposer_command", "proposer_env", "proposer_hosts", "proposer_url",
                "proposer_api_key_env")


def _started_with_path(run):
    import hashlib
    from lm.models import cache_dir
    return cache_dir() / "runs" / (hashlib.sha256(str(Path(run).resolve()).encode()).hexdigest()[:32] + ".json")


def started_with(run) -> dict:
    """What this machine recorded of the run's STARTED_WITH settings ({} when it has no record)."""
    import json
    try:
        saved = json.loads(_started_with_path(run).read_text())
        return saved if isinstance(saved, dict) else {}
    except (OSError, ValueError):
        return {}


def record_started_with(run, a):
    from rundir import run_dir as rd
    try:
        path = _started_with_path(run)
        path.parent.mkdir(parents=True, exist_ok=True)
        rd.write_json(path, {k: getattr(a, k) for k in STARTED_WITH})
    except OSError:
        pass  # without the record a resume asks for these settings again: safe, not lost
