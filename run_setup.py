"""
The command line checked, and the run directory opened: what whale.py does before its loop.

check_args finds every mistake a command line can hold (unknown names, missing files, flags
that contradict each other, a corrupt data file, a proposer endpoint that does not answer)
and raises UserError, which whale.py prints as one line with exit code 2, before anything is
written. open_run makes a new run directory with config.json, or reopens the one --resume
names with its saved settings, refusing a resume that would change what the run means.
"""
import importlib
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent


class UserError(Exception):
    """A mistake in the command line or the inputs: one line, exit code 2."""


def check_args(a):
    """Every mistake a command line can hold, found before a run directory exists. `a` is whale.Args;
    the method table METHODS lives beside it in whale.py, and the checks read its fields."""
    methods = sys.modules[type(a).__module__].METHODS  # whale.py's (also when it runs as __main__)
    if a.method not in methods and a.method != "eval":
        raise UserError(f"unknown method {a.method!r}; choose one of {', '.join([*methods, 'eval'])}")
    method = methods.get(a.method)  # None: --method eval
    if not (ROOT / "domains" / f"{a.domain}.py").exists() or a.domain.startswith("_"):
        raise UserError(f"unknown domain {a.domain!r}; choose searchqa, math or chess")
    if a.test_split not in ("test", "val"):
        raise UserError(f"unknown --test-split {a.test_split!r}; choose test or val")
    if a.engine not in ("hf", "vllm"):
        raise UserError(f"unknown engine {a.engine!r}; choose hf or vllm")
    if a.engine == "vllm" and importlib.util.find_spec("vllm") is None:  # optional: not in requirements.txt
        raise UserError("--engine vllm needs the vllm package, which this Python lacks: install "
                        "requirements-vllm.txt in its own environment (README, 'On GPUs'), or vllm on a CUDA machine")
    if a.harness and not Path(a.harness).is_file():
        raise UserError(f"harness file {a.harness} does not exist")
    if a.harness:
        import meta_harness  # the same check every proposed candidate gets
        try:
            why = meta_harness.static_check(Path(a.harness).read_text())
        except (OSError, UnicodeDecodeError) as e:
            why = f"cannot be read ({e})"
        if why:
            why = why.replace("syntax error", "does not parse")
            raise UserError(f"harness file {a.harness} is not a harness: {why}")
    if a.chat_format not in ("auto", "template", "plain"):
        raise UserError(f"unknown chat format {a.chat_format!r}; choose auto, template or plain")
    if a.proposer not in ("primitives", "self", "openai", "command"):
        raise UserError(f"unknown proposer {a.proposer!r}; choose primitives, self, openai or command")
    if a.proposer == "openai" and not (a.proposer_url or os.environ.get("WHALE_PROPOSER_URL")):
        raise UserError("--proposer openai needs --proposer-url (or WHALE_PROPOSER_URL)")
    check_proposer_flags(a)
    if a.proposer == "openai":  # a down endpoint is a mistake to report now, not after the first weight phase
        import proposers
        why = proposers.endpoint_error(a.proposer_url or os.environ["WHALE_PROPOSER_URL"], a.proposer_model or None,
                                       os.environ.get(a.proposer_api_key_env))
        if why:
            raise UserError(why)
    if a.proposer == "command" and not a.proposer_command:
        raise UserError("--proposer command needs --proposer-command")
    # counts: a zero batch would never finish, a negative "first N" would slice from the end ([:-1])
    for flags, least in ((("budget", "prompts_per_step", "group", "candidates", "test_n", "val_n", "harness_n",
                           "minibatch", "micro_batch", "max_tokens", "tp"), 1),
                         (("test_limit", "val_limit", "test_subset", "harness_examples", "train_layers",
                           "max_kept_per_prompt", "top_k"), 0)):
        for flag in flags:
            if getattr(a, flag) < least:
                raise UserError(f"--{flag.replace('_', '-')} must be {'> 0' if least else '>= 0'}, "
                                f"not {getattr(a, flag)}")
    if a.lr < 0 or a.clip <= 0 or not 0 <= a.accept_alpha <= 1:
        raise UserError("--lr must be >= 0, --clip > 0 and --accept-alpha in [0, 1]")
    import switch
    try:
        policy = switch.parse_schedule(a.schedule)
    except ValueError as e:
        raise UserError(str(e))
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
            raise UserError(f"cannot load the {a.domain} {split} split from {domain.DATA}: {type(e).__name__}: {e}")
    if method and method.weights_until == "switch" and isinstance(policy, switch.Patience):  # (a small budget)
        min_w = policy.min_w or switch.epochs_to_steps(0.2, max(1, sizes["weight"] // a.prompts_per_step))
        if min_w * step >= a.budget:
            raise UserError(f"--schedule {a.schedule}: the first weight phase lasts at least {min_w} steps "
                            f"({min_w * step} rollouts, 0.2 epoch unless min_w is given), the whole --budget "
                            f"{a.budget}, so no harness phase would run; scale it, e.g. adaptive:w=2,pw=2,min_w=2")

    check_model(a)


def check_model(a):
    """--model (on --resume: the checkpoint the run continues from, if it holds the whole model)
    loads as a causal LM with a tokenizer in --chat-format, with the layers --train-layers trains:
    config, tokenizer and an empty model, no weights read (engine.check_model)."""
    import engine  # (imports torch: last, after the checks that need nothing)
    # (".checkpoint.old": a run killed between the two renames of a checkpoint; open_run puts it back)
    ckpts = [Path(a.resume) / d for d in ("checkpoint", ".checkpoint.old")] if a.resume else []
    name = next((str(c) for c in ckpts if (c / "state.json").exists() and (c / "model.safetensors").exists()),
                a.model)
    try:
        engine.check_model(name, a.chat_format, a.train_layers)
    except engine.ModelError as e:
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


def check_proposer_flags(a):
    """The phase-B proposer flags: values in range, and none given to a proposer that ignores it."""
    if a.proposer_max_tokens <= 0 or a.proposer_timeout < 0 or a.proposer_digest_chars < 1000:
        raise UserError("--proposer-max-tokens must be > 0, --proposer-timeout >= 0 and --proposer-digest-chars >= 1000")
    if a.proposer_format not in ("any", "file", "edit"):
        raise UserError(f"unknown --proposer-format {a.proposer_format!r}; choose any, file or edit")
    defaults = type(a)()
    for flag, users in (("proposer_max_tokens", ("self", "openai")), ("proposer_format", ("self", "openai")),
                        ("proposer_timeout", ("openai", "command")), ("proposer_api_key_env", ("openai",)),
                        ("proposer_digest_chars", ("self", "openai", "command"))):
        if getattr(a, flag) != getattr(defaults, flag) and a.proposer not in users:
            raise UserError(f"--{flag.replace('_', '-')} is only used by --proposer {' or '.join(users)}, "
                            f"not --proposer {a.proposer}")
    if a.proposer == "openai" and a.proposer_api_key_env != defaults.proposer_api_key_env \
            and not os.environ.get(a.proposer_api_key_env):
        raise UserError(f"--proposer-api-key-env {a.proposer_api_key_env}: that environment variable is not set")


def open_run(a):
    """A new run directory with config.json, or the one --resume names (with its saved args).
    `a` is whale.Args; its class gives the defaults a resumed run is compared against."""
    import run_dir as rd  # (imports torch: not needed to print --help or a flag error)
    Args = type(a)
    if a.resume:
        run = Path(a.resume)
        if not (run / "config.json").exists():
            raise UserError(f"{run} is not a run directory (no config.json)")
        saved = read_json_or_fail(run / "config.json", f"--resume {run}")
        if (run / "checkpoint").exists():  # written atomically; damaged only from outside
            read_json_or_fail(run / "checkpoint" / "state.json", f"--resume {run}")
        for k in ("domain", "method", "seed"):
            if getattr(a, k) != getattr(Args(), k) and getattr(a, k) != saved.get(k):
                raise UserError(f"--resume {run}: that is a {k}={saved.get(k)} run, not {k}={getattr(a, k)}")
        hardware = {k: getattr(a, k) for k in ("device", "engine", "tp") if getattr(a, k) != getattr(Args(), k)}
        for k, v in vars(a).items():  # a resumed run keeps its settings (the hardware it runs on may change)
            if k not in ("resume", "out", "domain", "method", "seed", *hardware) and v != getattr(Args(), k) \
                    and v != saved.get(k):
                raise UserError(f"--resume {run}: --{k.replace('_', '-')} cannot change on resume "
                                f"(the run has {saved.get(k)!r})")
        a = Args(**{**saved, **hardware, "resume": str(run)})
        check_args(a)
        rd.clean_partial(run)
        return run, a
    check_args(a)
    run = Path(a.out or f"runs/{a.domain}-{a.method}-s{a.seed}")
    if (run / "config.json").exists():
        raise UserError(f"{run} already holds a run; pass --resume {run} or another --out")
    run.mkdir(parents=True, exist_ok=True)
    rd.write_json(run / "config.json", vars(a))
    return run, a
