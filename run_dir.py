"""
The run directory runs/<name>/: everything a run writes, and how it resumes.

  config.json        vars(args) of the run
  metrics.jsonl      one line per rollout step, harness iteration and evaluation, and a
                     "start" line each time a process starts or resumes the run (git commit, argv)
  checkpoint/        the latest completed state: the model in HF format (loadable by
                     transformers and vLLM), the optimizer, and state.json (phase,
                     counters, loader, current harness, evaluations so far)
  best_val/          the checkpoint with the best validation score (for best-on-val test)
  harnesses/         every accepted harness as a .py file
  archive/           phase B archives (meta_harness.py), one folder per harness phase
  summary.json, curve.png

Crash safety: a checkpoint is written into a temp folder and renamed into place,
so a reader sees the old one or the new one, never half of one. metrics.jsonl
may hold lines written after the last checkpoint; on resume it is cut back to
the line count the checkpoint recorded, and those steps run again (with the same
seeds, so they produce the same lines).

The first test evaluation of (base model, h0) is the same for every method of a domain
and seed, so it is cached in ~/.cache/whale/evals and reused (eval_key says what it
depends on).

Left out: keeping every checkpoint (only latest and best-on-validation stay).
"""
import hashlib
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import torch


_CRASH_COUNTS = {}


def crash_point(name: str):
    """Testing aid for crash-anywhere resume: with WHALE_CRASH_AT=name:N in the
    environment, the N-th arrival at `name` kills this process with SIGKILL, as a
    power cut would. Points: sampling, sft, harness_eval, checkpoint, checkpoint_swap."""
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
    """Drop metrics lines written after the checkpoint we resume from, and any line a kill cut
    short (it has no newline or does not parse), so the next row starts on a line of its own.
    Returns the number of lines kept (the count the resumed run continues from)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines(keepends=True)[:lines]:
        try:
            json.loads(line)
        except ValueError:
            break  # a torn line: it and everything after it are redone from the checkpoint
        if not line.endswith("\n"):
            break
        kept.append(line)
    path.write_text("".join(kept))
    return len(kept)


def save_checkpoint(run: Path, engine, optimizer, state: dict, name: str = "checkpoint", model_changed=True):
    """Write model + tokenizer + optimizer + state into run/name atomically.
    When the model did not change since the last checkpoint (a harness phase),
    the weights file is hard-linked instead of written again."""
    target = run / name
    tmp = Path(tempfile.mkdtemp(dir=run, prefix=f".{name}.tmp"))
    old_weights = target / "model.safetensors"
    if not model_changed and old_weights.exists():
        engine.model.config.save_pretrained(tmp)
        engine.model.generation_config.save_pretrained(tmp)
        os.link(old_weights, tmp / "model.safetensors")
    else:
        engine.model.save_pretrained(tmp)
    engine.tokenizer.save_pretrained(tmp)
    if optimizer is not None:
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


def copy_checkpoint(run: Path, src: str, dst: str):
    """dst := src (hard links, atomically), e.g. checkpoint -> best_val."""
    tmp = Path(tempfile.mkdtemp(dir=run, prefix=f".{dst}.tmp"))
    for f in (run / src).iterdir():
        os.link(f, tmp / f.name)
    shutil.rmtree(run / dst, ignore_errors=True)
    os.rename(tmp, run / dst)


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
    """curve.png: validation and test mean@k vs cumulative target rollouts (matplotlib optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for split in ("val", "test"):
        pts = [(e["rollouts"], e["mean"], e["se"]) for e in evals if e["split"] == split]
        if pts:
            x, y, s = zip(*pts)
            n = next(e["n"] for e in evals if e["split"] == split)
            ax.errorbar(x, y, yerr=s, marker="o", capsize=3, label=f"{split} mean@{n}")
    ax.set_xlabel("target rollouts")
    ax.set_ylabel("mean@k")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run / "curve.png", dpi=100)
    plt.close(fig)
    return run / "curve.png"


def eval_key(args: dict, harness: str, examples, n: int, split: str) -> str:
    """Everything an evaluation's result depends on: model, engine, harness source, the
    exact examples, samples per example, seed and sampling settings."""
    ids = ",".join(e["id"] for e in examples)
    parts = [args[k] for k in ("domain", "model", "engine", "seed", "temperature", "top_k", "top_p", "max_tokens")]
    return hashlib.sha256(json.dumps([*parts, harness, ids, n, split], default=str).encode()).hexdigest()[:24]


def load_cached_eval(key):
    from engine import cache_dir
    path = cache_dir() / "evals" / f"{key}.json"
    if key and path.exists():
        return {**read_json(path), "cached": True}
    return None


def store_cached_eval(key, res):
    from engine import cache_dir
    if key and not res.get("cached"):
        (cache_dir() / "evals").mkdir(parents=True, exist_ok=True)
        write_json(cache_dir() / "evals" / f"{key}.json", res)
