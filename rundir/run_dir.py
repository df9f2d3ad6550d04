"""
The run directory runs/<name>/ and the loop's bookkeeping in it: everything a run writes,
how it resumes, and the one DDP sync point.

  config.json        vars(args) of the run
  metrics.jsonl      one line per rollout step, harness iteration and evaluation, and a
                     "start" line each time a process starts or resumes the run (git commit, argv)
  checkpoint/        the latest completed state: state.json (phase, counters, loader, current
                     harness, evaluations so far), the optimizer (until the run finishes) and
                     the weights: with --train-layers K > 0 only the trained blocks
                     (trained.safetensors) and base.json, the --model they sit on and its
                     weights' fingerprint (a load on other base weights is refused); with
                     --train-layers 0 (the default) the whole model in HF format, bf16 once the
                     run ends; --method eval: no weights
  best_val/          the weights with the best validation score (for best-on-val test), no optimizer
  harnesses/         every accepted harness as a .py file
  archive/           phase B archives (meta_harness.py), one folder per harness phase
  summary.json, curve.png  (summary.json also says the machine: matmul GFLOP/s, peak memory)
  .lock              held by the process running the run (run_setup.lock_run), holds its pid
  tracker.json       with --tracker (tracking.py): the tracker run's id and the rows each backend
                     has been sent; tensorboard/, mlruns/, wandb/ are the backends' own files

Crash safety: a checkpoint is written into a temp folder and renamed into place,
so a reader sees the old one or the new one, never half of one. metrics.jsonl
may hold lines written after the last checkpoint; on resume it is cut back to
the line count the checkpoint recorded, and those steps run again (with the same
seeds, so they produce the same lines).

The first test evaluation of (base model, h0) is the same for every method of a domain
and seed, so it is cached in ~/.cache/whale/evals and reused (eval_key says what it
depends on).

Run is the loop's handle on all of this (whale.py calls it, and nothing below it does): open
or resume, the state a checkpoint saves, metrics lines, the rollout budget spent so far, and
under torchrun the rank, with rank 0's state broadcast to the others after each phase.

Left out: keeping every checkpoint (only latest and best-on-validation stay).
"""
import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from rundir import phases  # what each phase did: the closing table, the curve's spans
from rundir.ddp import broadcast, ddp_setup  # (the torchrun plumbing: a no-op in one process)
from rundir.exits import UserError  # a damaged file or a full disk: one line, exit 2


_CRASH_COUNTS = {}


def crash_point(name: str):
    """Testing aid for crash-anywhere resume (rollout.py, rs_sft.py, evaluation.py, whale.py and
    this file call it): with WHALE_CRASH_AT=name:N in the
    environment, the N-th arrival at `name` kills this process with SIGKILL, as a
    power cut would. Points: sampling, sft, harness_eval, eval, checkpoint, checkpoint_swap."""
    want, _, n = os.environ.get("WHALE_CRASH_AT", "").partition(":")
    if want == name:
        _CRASH_COUNTS[name] = _CRASH_COUNTS.get(name, 0) + 1
        if _CRASH_COUNTS[name] == int(n or 1):
            os.kill(os.getpid(), signal.SIGKILL)


def write_json(path, obj):
    """Atomic JSON write (temp file + rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def log_metrics(run: Path, row: dict, state: dict):
    """Append one line to metrics.jsonl and count it in the state."""
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    state["metrics_lines"] = state.get("metrics_lines", 0) + 1


def matmul_gflop_per_s(n=1024, reps=5) -> float:
    """This machine's fp32 matmul speed (the best of `reps` n^3 products, ~0.1 s): what a run's
    minutes scale with, so that a time quoted here reads on any machine (summary.json keeps it)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return round(2 * n ** 3 / best / 1e9, 1)


def peak_rss_mb() -> dict:
    """Peak resident memory so far of this process (ru_maxrss). Its children's own figure would mislead:
    a child's ru_maxrss counts the parent's pages it shared between fork and exec."""
    import resource
    return {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def tree_pss_mb() -> int:
    """What this process and all of its descendants (the sandbox's router and rollout processes, an
    agent) hold now, MB: the sum of their proportional set sizes (PSS: a page shared by k processes
    counts 1/k in each), so shared pages count once. Linux /proc; 0 elsewhere."""
    children = {}
    try:
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # (the name may hold spaces and ")")
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(ppid, []).append(int(d))
    except OSError:
        return 0
    kb, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                kb += next((int(x.split()[1]) for x in f if x.startswith("Pss:")), 0)
        except OSError:
            pass  # (a process that ended between the two reads)
    return round(kb / 1024)


def watch_tree_memory(every: float = 1.0) -> dict:
    """A daemon thread samples tree_pss_mb every `every` seconds; the dict it returns holds the
    largest sample so far ("peak_tree_mb"): the run's whole footprint, children included, to about a
    second (a peak shorter than that can be missed)."""
    import threading
    peak = {"peak_tree_mb": tree_pss_mb()}

    def sample():
        while True:
            time.sleep(every)
            peak["peak_tree_mb"] = max(peak["peak_tree_mb"], tree_pss_mb())
    threading.Thread(target=sample, name="tree-memory", daemon=True).start()
    return peak


def rss_now_and_peak_mb() -> dict:
    """This process's resident memory now and its peak so far (Linux /proc: VmRSS, VmHWM; {} elsewhere).
    Every metrics.jsonl line carries both, so the line after which the peak rose is the work that
    raised it (a step, a candidate, an evaluation): where a run's memory goes, read from any run."""
    try:
        with open("/proc/self/status") as f:
            kb = {k: int(v.split()[0]) for k, v in (x.split(":", 1) for x in f if x.startswith(("VmRSS", "VmHWM")))}
        return {"rss_mb": round(kb["VmRSS"] / 1024), "peak_rss_mb": round(kb["VmHWM"] / 1024)}
    except (OSError, KeyError, ValueError):
        return {}


def code_version() -> str:
    """The git commit this code runs at, with '+dirty' when tracked code or data differ from it
    (results/ and *.md do not count: run records and prose change while runs go on), or 'unknown'
    outside a git checkout: which code produced a run, for its metrics.jsonl."""
    import subprocess
    git = ["git", "-C", str(Path(__file__).resolve().parent)]
    try:
        commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no", "--", ".",
                                      ":(exclude)results", ":(exclude)*.md"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if commit.returncode != 0:
        return "unknown"
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def truncate_metrics(run: Path, lines: int):
    """Drop metrics lines written after the checkpoint we resume from, and a last line a kill cut
    short (no newline, or it does not parse: dropped with a warning), so the next row starts on a
    line of its own. A damaged line with lines after it is not a kill's doing: one line (UserError)
    naming it. Fewer lines than the checkpoint counted (the file cut or emptied from outside): a
    warning saying how many are gone. Returns the number of lines kept."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    raw = path.read_bytes().split(b"\n")
    torn = raw.pop()  # after the last newline: b"" when the file ends cleanly
    body = raw[:lines]
    kept = []
    for k, line in enumerate(body):
        try:
            row = json.loads(line.decode("utf-8"))
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except (ValueError, RecursionError) as e:
            if k < len(raw) - 1:  # lines follow it: damage, not a torn write
                raise UserError(f"{path} line {k + 1} is damaged ({type(e).__name__}); fix or remove that line, "
                                f"then --resume {run} again (the checkpoint does not need it)") from None
            torn = line
            break
        kept.append(line + b"\n")
    if torn and len(kept) < lines:
        print(f"whale: warning: {path}: its last line was cut short ({len(torn)} bytes, a kill while writing); "
              "dropped, the resumed run writes it again", file=sys.stderr)
    if len(kept) + (1 if torn and len(kept) < lines else 0) < lines:
        print(f"whale: warning: {path} has {len(kept)} of the {lines} lines the checkpoint counted: "
              f"{lines - len(kept)} are gone (cut or emptied from outside); the run goes on, its report lacks them",
              file=sys.stderr)
    path.write_bytes(b"".join(kept))
    return len(kept)


# --max-memory's default on a CPU run (-1, "auto"): the first run fits an 8 GB laptop beside the OS and a
# browser (results/first-run run 16: peak 4,079 MB RSS, the process tree 3,976, run 11's numbers)
AUTO_MAX_MEMORY_GB = 4.0


def save_checkpoint(run: Path, engine, optimizer, state: dict, name: str = "checkpoint", model_changed=True,
                    weights="all", base=None):
    """Write weights + optimizer + state into run/name atomically. weights:
      "all"      the whole model in HF format with its tokenizer (full fine-tuning: transformers
                 and vLLM load the folder as it is);
      "trained"  only the parameters that train (--train-layers K: the top K blocks and the final
                 norm) in trained.safetensors, and base.json (`base`: the --model and the
                 fingerprint of the weights they sit on, which every load checks);
      "none"     no weights and no optimizer (--method eval: nothing trains).
    When the model did not change since the last checkpoint (a harness phase, an evaluation),
    the weights file and the optimizer's state are hard-linked instead of written again."""
    target = run / name
    tmp = Path(tempfile.mkdtemp(dir=run, prefix=f".{name}.tmp"))
    if weights == "all":
        old_weights = target / "model.safetensors"
        if not model_changed and old_weights.exists():
            engine.model.config.save_pretrained(tmp)
            engine.model.generation_config.save_pretrained(tmp)
            os.link(old_weights, tmp / "model.safetensors")
        else:
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()  # ("Writing model shards": the run's own bar and step line say it)
            engine.model.save_pretrained(tmp)
        engine.tokenizer.save_pretrained(tmp)
    elif weights == "trained":
        from safetensors.torch import save_file
        old_weights = target / "trained.safetensors"
        if not model_changed and old_weights.exists():
            os.link(old_weights, tmp / "trained.safetensors")
        else:
            save_file({k: p.detach().contiguous() for k, p in engine.model.named_parameters() if p.requires_grad},
                      tmp / "trained.safetensors")
        write_json(tmp / "base.json", base)
    if optimizer is not None and weights != "none":
        old_optimizer = target / "optimizer.pt"
        if not model_changed and old_optimizer.exists():  # no step since: the same state (1 GB at full fine-tuning)
            os.link(old_optimizer, tmp / "optimizer.pt")
        else:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    write_json(tmp / "state.json", state)
    crash_point("checkpoint")
    old = run / f".{name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.rename(target, old)
    crash_point("checkpoint_swap")
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def damaged_file(path, run):
    """Reading a checkpoint file: any failure (truncated, empty, not what it should hold) is one
    line naming the file and what to do, never a traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{path} is damaged ({type(e).__name__}: {str(e)[:120]}); the run cannot continue from "
                        f"this checkpoint: start it again (another --out, or remove {run})") from None


def copy_checkpoint(run: Path, src: str, dst: str):
    """dst := src without the optimizer state (hard links, atomically), e.g. checkpoint -> best_val:
    a copy is for loading weights (best_val is scored on test), never for training on."""
    tmp = Path(tempfile.mkdtemp(dir=run, prefix=f".{dst}.tmp"))
    for f in (run / src).iterdir():
        if f.name != "optimizer.pt":
            os.link(f, tmp / f.name)
    shutil.rmtree(run / dst, ignore_errors=True)
    os.rename(tmp, run / dst)


def halve_weights(run: Path):
    """checkpoint/ and best_val/'s model.safetensors in bfloat16 where that loses nothing: every fp32
    value of the file is a bfloat16 value (an untrained model whose base was bf16: half the disk, 270
    MB a point for the 135M model, not 540), each distinct content once. A trained model stays fp32:
    halving one lost updates smaller than a bf16 step (lr 1e-5) and the run's exported agent then
    answered 11 of 100 test questions otherwise than the final test had scored it (issue 70): a run
    keeps the weights it scored. Atomic per file; trained-block checkpoints (--train-layers K) are
    small and stay as they are."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    def content(f):  # (the same bytes in two files: a run whose updates all were skipped)
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
        return h.hexdigest()
    by_file = {}
    for name in ("checkpoint", "best_val"):
        f = run / name / "model.safetensors"
        if f.exists():
            by_file.setdefault(content(f), []).append(f)
    for files in by_file.values():
        with safe_open(files[0], "pt") as src:
            meta = src.metadata() or {}
        tensors = load_file(files[0])
        wide = [t for t in tensors.values() if t.dtype == torch.float32]
        if not wide or not all(torch.equal(t.to(torch.bfloat16).float(), t) for t in wide):
            continue  # already narrow, or narrowing would change the weights the run scored
        half = files[0].with_name(".model.bf16.tmp")
        save_file({k: t.to(torch.bfloat16) if t.dtype == torch.float32 else t for k, t in tensors.items()}, half,
                  metadata=meta)
        for f in files:
            os.link(half, f.with_name(".model.bf16.link"))
            os.replace(f.with_name(".model.bf16.link"), f)
            config = f.with_name("config.json")
            if config.exists():  # what `from_pretrained(dtype="auto")` reads
                c = read_json(config)
                c.update({k: "bfloat16" for k in ("torch_dtype", "dtype") if k in c} or {"torch_dtype": "bfloat16"})
                write_json(config, c)
        half.unlink()


def clean_partial(run: Path):
    """Remove temp folders a killed run left behind (never a finished checkpoint)."""
    for p in run.glob(".*.tmp*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for name in ("checkpoint", "best_val"):
        old = run / f".{name}.old"
        if old.exists() and not (run / name).exists():
            os.rename(old, run / name)  # killed between the two renames: the old one is still whole
        shutil.rmtree(old, ignore_errors=True)


def plot_curve(run: Path, evals: list[dict], title: str):
    """curve.png: validation and test mean@k vs cumulative target rollouts, the spans of phase A
    (weights) and phase B (harness) shaded (matplotlib optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    named = set()
    for p in phases.phases(run):  # which span was phase A (weights) and which phase B (harness)
        if p["rollouts_end"] > p["rollouts_start"]:
            label = "phase A (weights)" if p["phase"] == "A" else "phase B (harness)"
            ax.axvspan(p["rollouts_start"], p["rollouts_end"], color=phases.PHASE_FILL[p["phase"]], lw=0, zorder=0,
                       label=None if label in named else label)
            named.add(label)
    for split in ("val", "test"):
        pts = [(e["rollouts"], e["mean"], e["se"]) for e in evals if e["split"] == split]
        if pts:
            x, y, s = zip(*pts)
            n = next(e["n"] for e in evals if e["split"] == split)
            ax.errorbar(x, y, yerr=s, marker="o", capsize=3, color=phases.SPLIT_COLOUR.get(split, "#555"),
                        linestyle="-" if phases.joined(split) else "none",
                        label=f"{split} mean@{n}" + ("" if phases.joined(split) else " (start and end only)"))
    ax.set_xlabel("target rollouts")
    ax.set_ylabel("mean@k")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run / "curve.png", dpi=100)
    plt.close(fig)
    return run / "curve.png"


# the code that decides a score: the harness runner, the sampler (and the domain file itself)
SCORING_CODE = ("jail/sandbox.py", "jail/sandbox_child.py", "jail/isolation.py", "jail/landlock.py", "rollout.py",
                "lm/engine.py", "lm/chat_format.py", "lm/models.py", "lm/shared_prefix.py", "lm/int8.py",
                "lm/vllm_engine.py", "domains/__init__.py")  # (paths from the repository's root)


def eval_key(args: dict, domain, harness: str, examples, n: int, split: str) -> str:
    """Everything an evaluation's result depends on: model, engine, seed and sampling settings,
    the harness source, the exact examples and samples per example, and the bytes of the code
    that decides a score (SCORING_CODE and the domain's verifier and tools) and of the domain's
    data files, so that a fork that changes any of them, or swaps the data in through
    WHALE_DATA, never reads a stale entry."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent  # the repository's
    data = getattr(domain, "DATA", None)  # None: the domain generates its data (its file's bytes fix it)
    for path in [*(root / f for f in SCORING_CODE), Path(domain.__file__),
                 *(sorted(p for p in Path(data).iterdir() if p.is_file()) if data else [])]:
        h.update(path.name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"") + b"\0")
    parts = [args[k] for k in ("domain", "model", "engine", "seed", "temperature", "top_k", "top_p", "max_tokens")]
    if args.get("rollout_precision", "fp32") != "fp32":  # int8 samples other tokens (fp32 keys stay as they were)
        parts.append(args["rollout_precision"])
    h.update(json.dumps([*parts, harness, [e["id"] for e in examples], n, split], default=str).encode())
    return h.hexdigest()[:24]


def load_cached_eval(key):
    from lm.models import cache_dir
    path = cache_dir() / "evals" / f"{key}.json"
    if key and path.exists():
        return {**read_json(path), "cached": True}
    return None


def store_cached_eval(key, res):
    from lm.models import cache_dir
    if key and not res.get("cached"):
        (cache_dir() / "evals").mkdir(parents=True, exist_ok=True)
        write_json(cache_dir() / "evals" / f"{key}.json", res)


# -----------------------------------------------------------------------------
# The loop's handle on its run directory

# what a run counts besides its target rollouts (summary.json has each one, 0 if it never happened)
COUNTERS = ("prompt_tokens", "completion_tokens", "optimizer_steps", "proposer_calls", "proposer_prompt_tokens",
            "proposer_completion_tokens", "proposer_seconds", "proposer_cost_usd", "harness_candidates",
            "harness_invalid", "harness_accepted")


def new_state(phase, done, harness, loader):
    """The state of a run that has not started: everything a checkpoint saves and a resume reads
    (run.state; whale.py's loop and evaluation.py change it, a checkpoint writes it whole)."""
    return {
        "phase": phase,            # "A" (weights) or "B" (harness): what the loop runs next
        "done": done,              # the budget is spent (or --method eval): only the final evaluation is left
        "cycle": 0,                # harness phases finished (phase A of cycle c comes before phase B of cycle c)
        "steps": 0,                # RSFT steps so far, over the whole run
        "rollouts": 0,             # target rollouts spent (what the budget counts)
        "harness": harness,        # the current harness's source (the incumbent of the last harness phase)
        "loader": loader,          # phase A's prompt loader (rs_sft.new_loader): epoch and position
        "phase_rewards": [],       # this weight phase's train reward per step (what a switch policy reads)
        "evals": [],               # every evaluation point (evaluation.py): split, tag, mean, se, per question
        "best_val": None,          # the best validation point so far, with its harness (best_val/ holds its weights)
        "pending_eval": "initial", # the evaluation due before the loop goes on (a tag), or None
        "seconds": 0.0,            # wall time so far, over every resume
        "metrics_lines": 0,        # metrics.jsonl lines this state has seen (a resume cuts the file back to it)
        "counters": dict.fromkeys(COUNTERS, 0),  # tokens, optimizer steps, proposer use, candidates
        "kept_per_step": [], "trained_tokens_per_step": [], "capped_frac_per_step": [],  # phase A, per step
        "replay": []}              # --replay-steps: the kept sequences of earlier steps the next step trains on


class Run:
    """One run, new or resumed: its directory, the state its checkpoints save, metrics.jsonl,
    the progress bar and, under torchrun, this process's rank. Only rank 0 writes files."""
    tracker = None  # tracking.Tracker when --tracker names one (rank 0)

    def __init__(self, a, open_run):
        self.rank, self.world, self.device = ddp_setup(a.device)
        self.tree_memory = watch_tree_memory() if self.rank == 0 else {}  # the peak of the whole process tree
        self.dir, self.args = broadcast(open_run(a) if self.rank == 0 else None, self.world)
        saved = self.dir / "checkpoint" / "state.json"
        self.state = read_json(saved) if saved.exists() else None  # None: a new run (see start)
        if self.rank == 0 and self.state:  # cut metrics.jsonl back to what the checkpoint has seen
            self.state["metrics_lines"] = truncate_metrics(self.dir, self.state["metrics_lines"])
        elif self.rank == 0:
            truncate_metrics(self.dir, 0)

    def model_path(self, model):
        """Where the weights come from: a resumed run's checkpoint if it holds the whole model (full
        fine-tuning), else --model (the base; a light checkpoint's blocks go on it in start())."""
        whole = self.state and (self.dir / "checkpoint" / "model.safetensors").exists()
        return str(self.dir / "checkpoint") if whole else model

    def start(self, initial_state, optimizer, engine, weights):
        """Take the initial state (a new run) or the resumed one; restore the trained weights and the
        optimizer; log a start line. weights: what checkpoints hold, "all" | "trained" | "none"
        (save_checkpoint); for "trained", the base weights are fingerprinted here, before a
        resumed run's trained blocks are put on them."""
        from tqdm import tqdm
        from lm.models import weights_fingerprint
        if weights == "trained" and self.state and (self.dir / "checkpoint" / "model.safetensors").exists():
            weights = "all"  # a run begun with whole-model checkpoints (older code) goes on with them
        self.weights = weights
        if weights == "trained":
            self.base = {"model": self.args.model, "sha256": weights_fingerprint(engine.model)}
        if self.state is None:
            self.state = initial_state
        else:
            if (self.dir / "checkpoint" / "trained.safetensors").exists():
                self.load_weights("checkpoint", engine)
            if (self.dir / "checkpoint" / "optimizer.pt").exists():
                with damaged_file(self.dir / "checkpoint" / "optimizer.pt", self.dir):
                    optimizer.load_state_dict(torch.load(self.dir / "checkpoint" / "optimizer.pt"))
        self.t0 = time.time() - self.state["seconds"]
        a = self.args
        self.bar = tqdm(total=a.budget, initial=self.state["rollouts"], unit="rollout", desc=f"{a.method} {a.domain}",
                        dynamic_ncols=True, disable=self.rank != 0)
        if self.rank == 0:  # --tracker: the same tracker run again on a resume (None without one)
            from rundir import tracking
            self.tracker = tracking.open_tracker(self.dir, vars(a))
        self.gflops = matmul_gflop_per_s() if self.rank == 0 else None
        commit = code_version()
        self.log({"event": "start", "commit": commit, "argv": sys.argv[1:],  # which code made this run
                  "matmul_gflop_per_s": self.gflops},  # and on what machine (its speed)
                 console=f"start at commit {commit[:12]}{'+dirty' if commit.endswith('+dirty') else ''}, on a "
                         f"machine of {self.gflops or 0:.0f} fp32 matmul GFLOP/s (times scale with its inverse)")
        if self.rank == 0:
            self.bar.write(f"run directory {self.dir}: stop it any time, "
                           f"`python whale.py --resume {self.dir}` continues")

    def elapsed(self):
        return time.time() - self.t0

    def log(self, row, rollouts=None, console=None):
        """One line of metrics.jsonl and the console (rank 0). `rollouts` is the run's total so far:
        the state's count, unless the caller knows more (a harness phase books its rollouts in the
        state only when it ends, and passes the count at each of its events). `console`: a line
        to print instead of the row's key=value fields (metrics.jsonl keeps them all)."""
        if self.rank != 0:
            return
        row = {"t": round(self.elapsed(), 1), **row,  # (t and the memory fields: the machine's, not the run's)
               "rollouts": self.state["rollouts"] if rollouts is None else rollouts, **rss_now_and_peak_mb(),
               **self.tree_memory}
        log_metrics(self.dir, row, self.state)
        if self.tracker:  # every row to TensorBoard/MLflow/W&B too; metrics.jsonl stays the record
            self.tracker.log(row)
        self.bar.write(console or " ".join(f"{k}={round(v, 4) if isinstance(v, float) else v}"
                                           for k, v in row.items() if not isinstance(v, (list, dict)) and v is not None))

    def spend(self, rollouts, **counters):
        """Book target rollouts (the budget every method shares) and other counters (tokens, proposer calls)."""
        self.state["rollouts"] += rollouts
        for k, v in counters.items():
            v = self.state["counters"].get(k, 0) + v
            self.state["counters"][k] = round(v, 6) if isinstance(v, float) else v  # seconds, dollars

    def checkpoint(self, engine, optimizer, model_changed: bool):
        if self.rank == 0:
            self.state["seconds"] = self.elapsed()
            try:
                save_checkpoint(self.dir, engine, optimizer, self.state, model_changed=model_changed,
                                weights=self.weights, base=getattr(self, "base", None))
            except Exception as e:  # safetensors wraps ENOSPC in its own error type
                if not (isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left" in str(e)):
                    raise
                clean_partial(self.dir)  # the half-written copy; the last checkpoint is untouched
                need = sum(p.numel() * p.element_size() for p in engine.model.parameters()
                           if self.weights == "all" or p.requires_grad) * (3 if optimizer is not None else 1)
                raise UserError(f"no space left on the device of {self.dir} for a checkpoint (about {need >> 20} MB "
                                f"needed): free space, then `--resume {self.dir}` continues from the last one") from None

    def write_summary(self, tests, best_val_test, gain, two_by_two=None):
        """summary.json: the run's numbers in one file (results.py's tables read these). tests: the
        full-test evaluations by tag (initial, final, best_val); best_val_test: the one of them that
        scores the checkpoint chosen on validation; gain: (final - initial, its paired SE); two_by_two:
        evaluation.two_by_two's cells and effects (None: not scored)."""
        a, st = self.args, self.state
        initial, final = tests["initial"], tests.get("final", tests["initial"])
        best_test = max(tests.values(), key=lambda e: e["mean"])
        gain, gain_se = gain
        c = {**dict.fromkeys(COUNTERS, 0), **st["counters"]}
        summary = {
            "method": a.method, "domain": a.domain, "seed": a.seed, "model": a.model, "rollouts": st["rollouts"],
            "budget": a.budget, "cycles": st["cycle"], "steps": st["steps"],
            "test_mean8_initial": initial["mean"], "test_mean8_initial_se": initial["se"],
            "test_mean8_final": final["mean"], "test_mean8_final_se": final["se"],
            "test_gain": gain, "test_gain_se": gain_se,  # final - initial, SE paired over the same questions
            "test_mean8_best_val": best_val_test["mean"], "test_mean8_best_val_se": best_val_test["se"],
            "test_mean8_best_test": best_test["mean"], "test_mean8_best_test_se": best_test["se"],
            "best_test_note": "selected on the test split (the paper's metric), over the full-test evaluations "
                              f"of this run: {sorted(tests)}",
            "test_split": a.test_split, "test_examples": initial["examples"], "test_n": a.test_n,
            "test_subset_curve": a.test_subset, **c, "seconds": round(self.elapsed(), 1),
            # what each side had to learn from: phase A's kept rollouts and trained (model-written)
            # tokens per RSFT step; phase B's candidates that were valid, and accepted
            "kept_per_step": st.get("kept_per_step", []), "trained_tokens_per_step": st.get("trained_tokens_per_step", []),
            "capped_frac_per_step": st.get("capped_frac_per_step", []),  # the health figure: replies cut by the cap
            "harness_valid": c["harness_candidates"] - c["harness_invalid"],
            "phases": phases.phases(self.dir),  # what each phase did (rundir/phases.py)
            # the machine: its fp32 matmul speed (measured when this process started) and memory peaks
            "matmul_gflop_per_s": self.gflops, **peak_rss_mb(), **self.tree_memory,
            **({"test_2x2": two_by_two} if two_by_two else {})}
        write_json(self.dir / "summary.json", summary)
        return summary

    def print_summary(self, s):
        a = self.args
        print(f"\n{a.method} on {a.domain}, seed {a.seed}: {s['rollouts']} target rollouts in {s['seconds'] / 60:.1f} min")
        print(f"  {a.test_split} mean@{a.test_n} ({s['test_examples']} questions)  initial {s['test_mean8_initial']:.3f} "
              f"+- {s['test_mean8_initial_se']:.3f}   final {s['test_mean8_final']:.3f} +- {s['test_mean8_final_se']:.3f}")
        print(f"  gain {s['test_gain']:+.3f} +- {s['test_gain_se']:.3f} (SE of the per-question differences)")
        if s.get("phases"):
            print("\n".join(phases.table(self.dir, a.val_n)))
        if a.method != "eval":
            print(f"  best-on-validation checkpoint: {a.test_split} {s['test_mean8_best_val']:.3f} "
                  f"+- {s['test_mean8_best_val_se']:.3f}")
        if s.get("test_2x2"):  # the paper's claim inside this run: which half moved the number
            c = s["test_2x2"]
            print(f"  2 x 2 ({c['questions']} questions): base weights {c['base_h0']:.3f} with the starting harness, "
                  f"{c['base_weights_final_harness']:.3f} with the final one; final weights {c['final_weights_h0']:.3f}, "
                  f"{c['final']:.3f}")
            print("  " + ", ".join(f"{k.replace('_', ' ')} {c[k]:+.3f} +- {c[k + '_se']:.3f}"
                                   for k in ("weights_alone", "harness_alone", "together", "interaction")))
        if s.get("matmul_gflop_per_s"):
            print(f"  machine: fp32 matmul {s['matmul_gflop_per_s']:.0f} GFLOP/s (times scale with its inverse); peak "
                  f"memory {s.get('peak_tree_mb', 0)} MB (the process tree's PSS), this process's RSS {s['peak_rss_mb']} MB")
        print(f"  files: {self.dir}/ (summary.json, metrics.jsonl, harnesses/, checkpoint/, curve.png)")

    def finish_tracker(self, page):
        """The tracker's run ends with the summary numbers, the final harness and report.html (`page`:
        its path, None when it was not written)."""
        if self.tracker:
            self.tracker.finish(read_json(self.dir / "summary.json"), self.state["harness"], page)

    def keep_checkpoint_as(self, name):
        copy_checkpoint(self.dir, "checkpoint", name)

    def load_weights(self, name, engine):
        """Put the weights of checkpoint `name` (e.g. best_val) into the engine. Trained blocks go
        only on the base they were trained on: another one is refused in one line (exit 2), and so
        is a damaged file (damaged_file)."""
        from safetensors.torch import load_file
        d = self.dir / name
        src = d / "trained.safetensors"
        if src.exists():
            with damaged_file(d / "base.json", self.dir):
                base = read_json(d / "base.json")
                if not isinstance(base, dict) or not isinstance(base.get("sha256"), str):
                    raise ValueError("no sha256 fingerprint in it")
            if base["sha256"] != self.base["sha256"]:
                raise UserError(f"{d} holds blocks trained on other base weights than --model {self.args.model} "
                                f"loads now (fingerprint {base['sha256'][:12]}, not {self.base['sha256'][:12]}); "
                                f"give it the model it was trained on")
        else:
            src = d / "model.safetensors"
        with damaged_file(src, self.dir):
            weights = load_file(src)
            params = engine.model.state_dict()
            wrong = [k for k, v in weights.items() if k not in params or v.shape != params[k].shape]
            if wrong:
                raise ValueError(f"{len(wrong)} tensors this model does not have, e.g. {wrong[0]}")
            engine.model.load_state_dict(weights, strict=False)
        engine.sync_weights()

    def fit_memory(self, engine, gb, training_bytes_per_position) -> int:
        """--max-memory: what the process holds now, the optimizer state still to come (AdamW: two fp32
        tensors a trainable parameter; the gradients are freed after each update, rs_sft.sft_update,
        so the sampler never runs beside them) and ~0.5 GB for the rest (data, index, freed memory
        glibc keeps) are reserved; the sampler's caps take what is left (engine.fit_to_memory). A
        training forward gets what is left beside the gradients too: returns the positions one may run
        (at training_bytes_per_position, rs_sft's estimate; at least 256; 0: no cap).
        gb -1 (the default, "auto"): AUTO_MAX_MEMORY_GB on a CPU run when the model fits in it with
        256 MB to spare, else no limit (a GPU's memory is not RAM, and a larger model needs more)."""
        from lm.engine import fit_to_memory, kv_bytes_per_position
        auto = gb < 0
        if auto and (self.args.device != "cpu" or self.args.engine != "hf"):  # (vLLM sizes its own cache)
            return 0
        gb = AUTO_MAX_MEMORY_GB if auto else gb
        trainable = sum(p.numel() * p.element_size() for p in engine.model.parameters() if p.requires_grad)
        per_position = kv_bytes_per_position(engine)  # first: its forward brings the mapped weights into RSS
        reserved = rss_now_and_peak_mb().get("rss_mb", 0) * 2**20 + 2 * trainable + 2**29
        # rounded up to 128 MB: the RSS read here moves by a few MB between two processes of the same run,
        # and a cap that moved with it would cut training forwards elsewhere, and so sum in another order
        reserved = -(-reserved // 2**27) * 2**27
        if auto and gb * 2**30 - reserved < 2**28:
            self.log({"event": "memory_fit", "max_memory_gb": 0, "reserved_gb": round(reserved / 2**30, 2)},
                     console=f"--max-memory auto: no limit (this model needs about {reserved / 2**30:.1f} GB "
                             f"before its rollouts, more than {gb:g}; give --max-memory GB to size it)")
            return 0
        caps = fit_to_memory(engine, gb, reserved, per_position)
        caps["max_forward_tokens"] = max(256, int((gb * 2**30 - reserved - trainable) / training_bytes_per_position))
        warning = (f"; warning: the weights, optimizer state and process take about {caps['reserved_gb']} GB, so these "
                   f"are the smallest caps and the run will use more than {gb:g} GB") if caps["too_small"] else ""
        self.log({"event": "memory_fit", "max_memory_gb": gb, **caps},
                 console=f"--max-memory {'auto: ' if auto else ''}{gb:g} GB: sampler batches of at most "
                         f"{caps['max_cache_positions']} cache positions, prefill forwards of at most "
                         f"{caps['max_prefill_tokens']}, training forwards of at most {caps['max_forward_tokens']}{warning}")
        return caps["max_forward_tokens"]

    def drop_optimizer(self):
        """A finished run trains no more: its optimizer state (2x the trained weights) goes, and a
        whole model is kept in bfloat16 only where that changes no value (halve_weights)."""
        (self.dir / "checkpoint" / "optimizer.pt").unlink(missing_ok=True)
        halve_weights(self.dir)

    def sync(self):
        """The one DDP sync point: every rank takes rank 0's state (a no-op in one process)."""
        self.state = broadcast(self.state, self.world)
