"""
Ship what a run found: its weights merged into one Hugging Face model directory, its harness,
and a record of where they came from and how they scored.

    python tools/export.py runs/searchqa-whale-s0 agent/                       # the run's last point
    python tools/export.py runs/searchqa-whale-s0 agent/ --checkpoint best_val # the point chosen on val

  OUT/model/      a complete HF model directory: the trained parameters merged into the base (a
                  full fine-tuning run's whole model, or a --train-layers K run's blocks put on the
                  base they were trained on, whose fingerprint is checked), with the tokenizer, its
                  chat template and the generation config. AutoModelForCausalLM.from_pretrained
                  and `vllm serve OUT/model` load it.
  OUT/harness.py  that point's harness (the final harness, or the one best_val was scored with)
  OUT/agent.json  base model, run, commit, method, budget, the sampling settings it was scored at,
                  test mean@k with its SE and question count, and the harness changes the sign
                  test accepted, with what each tried
  OUT/README.md   the same for a reader, and how to run it
With --to-tracker the bundle is also logged as the model artifact of the run's own MLflow or W&B
run (rundir/tracking.log_bundle).

A run that has not finished is refused in one line (exit 2), or, with --unfinished, exported from
its last checkpoint with a warning that agent.json and the README repeat. Everything is written
into a temporary directory beside OUT and renamed at the end: never a half-written OUT.

The bundle is the agent the run scored: the weights in the narrowest precision that holds every
value exactly (bfloat16 for an untrained model whose base is bf16, fp32 for a trained one: no
upcast, no rounding), and no path of the exporting machine (agent.json names the run directory only).
Left out: running the exported agent (its harness needs `llm` and `tools` as the sandbox gives
them; tools/run_agent.py does that).
"""
import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tools/x.py` imports the repository's modules


class ExportError(Exception):
    """A mistake in what was asked: one line, exit 2."""


def read_json(path: Path, what: str):
    """A JSON object of the run (read as someone else's file: no symbolic link followed, size capped)."""
    from jail import received
    try:
        obj = received.read_json(path)
    except (OSError, ValueError) as e:
        raise ExportError(f"{what}: {path} is missing or damaged ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ExportError(f"{what}: {path} is not a JSON object")
    return obj


def point_of(run: Path, checkpoint: str, unfinished: bool) -> dict:
    """What the exported point is: its weights folder, harness, scores and the run's record."""
    if not (run / "config.json").exists():
        raise ExportError(f"{run} is not a run directory (no config.json)")
    config = read_json(run / "config.json", "the run's settings")
    summary = read_json(run / "summary.json", "the run's summary") if (run / "summary.json").exists() else None
    if summary is None and not unfinished:
        raise ExportError(f"{run} has not finished (no summary.json): finish it with `python whale.py --resume {run}`, "
                          "or pass --unfinished to export its last checkpoint")
    state = read_json(run / "checkpoint" / "state.json", "the run's last checkpoint")
    folder = run / ("checkpoint" if checkpoint == "final" else "best_val")
    if config.get("method") == "eval":
        raise ExportError(f"{run} is a --method eval run: it trained nothing; export the run it scored")
    if not folder.is_dir():
        raise ExportError(f"{run} has no {folder.name}/ (a run keeps best_val/ once validation has scored a point)")
    tests = {e.get("tag"): e for e in state.get("evals", []) if e.get("split") == "test"}
    if checkpoint == "final":
        harness, score = state["harness"], tests.get("final")
    else:
        best = state.get("best_val") or {}
        harness = best.get("harness") or state["harness"]
        score = tests.get("best_val") or (tests.get("final") if best.get("rollouts") == state.get("rollouts") else None)
        if best.get("tag") == "initial":
            score = tests.get("initial")
    return dict(config=config, summary=summary, state=state, folder=folder, harness=harness, score=score)


def merged_model(folder: Path):
    """(model, tokenizer) of a checkpoint folder: the whole model, or the trained blocks on their
    base (models.load_model checks the base's fingerprint)."""
    from lm import models
    if not ((folder / "model.safetensors").exists() or (folder / "trained.safetensors").exists()):
        raise ExportError(f"{folder} holds no weights (model.safetensors or trained.safetensors)")
    try:
        return models.load_model(str(folder))
    except models.ModelError as e:
        raise ExportError(str(e)) from None
    except Exception as e:  # a truncated safetensors file, a damaged config
        raise ExportError(f"{folder}: its weights do not load ({type(e).__name__}: {str(e)[:200]})") from None


def narrowest_exact(model):
    """The model in bfloat16 if every parameter is a bf16 value (nothing lost: it scores as it did),
    else as it is (fp32): the precision its scores were measured in, at the least disk."""
    import torch
    if all(torch.equal(p.detach().to(torch.bfloat16).float(), p.detach().float()) for p in model.parameters()):
        return model.to(torch.bfloat16)
    return model


def halved_after_scoring(point: dict) -> bool:
    """A run from before issue 70 kept a trained whole model in bfloat16 after scoring it in fp32:
    its export is not exactly the agent its final test scored."""
    config = point["folder"] / "config.json"
    dtype = read_json(config, "the checkpoint's model config").get("dtype") if config.exists() else None
    return dtype == "bfloat16" and point["state"].get("counters", {}).get("optimizer_steps", 0) > 0


def accepted_changes(run: Path) -> list[dict]:
    from rundir import phases
    return [dict(cycle=p["cycle"], **a) for p in phases.phases(run) if p["phase"] == "B" for a in p["accepted"]]


def commit_of(run: Path) -> str:
    for line in (run / "metrics.jsonl").read_text(errors="replace").splitlines()[:5]:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "start":
            return e.get("commit", "unknown")
    return "unknown"


def readme(agent: dict) -> str:
    s = agent["test"]
    score = ("not scored on test" if s is None else
             f"{s['split']} mean@{s['n']} {s['mean']:.3f} +- {s['se']:.3f} on {s['examples']} questions")
    lines = [f"# {agent['method']} on {agent['domain']}: an exported agent", "",
             f"Exported from `{agent['run']}` ({agent['checkpoint']} point) at commit {agent['commit']}.",
             *([f"**Warning: {agent['warning']}**", ""] if agent.get("warning") else [""]),
             f"- base model: `{agent['base_model']}`; weights: `model/` ({agent['weights']}, {agent['dtype']})",
             f"- harness: `harness.py`; scored at {score}",
             f"- sampling: temperature {agent['sampling']['temperature']}, top-k {agent['sampling']['top_k']}, "
             f"top-p {agent['sampling']['top_p']}, at most {agent['sampling']['max_tokens']} new tokens a call, "
             f"chat format {agent['chat_format']}",
             f"- budget: {agent['budget']} target rollouts, seed {agent['seed']}", "",
             "Harness changes the sign test accepted:", ""]
    lines += [f"- phase B{c['cycle']}: {c['cand']} ({c['axis'] or 'code'}): {c['hypothesis']}"
              for c in agent["accepted_changes"]] or ["- none (the harness is the starting one)"]
    lines += ["", "Load the model: `AutoModelForCausalLM.from_pretrained('model')`, or serve it: `vllm serve model`.", ""]
    return "\n".join(lines)


def export(run_dir: str, out: str, checkpoint: str = "final", unfinished: bool = False) -> Path:
    run, out = Path(run_dir), Path(out)
    if out.exists():
        raise ExportError(f"{out} already exists; choose another OUT or remove it")
    point = point_of(run, checkpoint, unfinished)
    from harness_search.harness_source import static_check
    why = static_check(point["harness"])
    if why:
        raise ExportError(f"the {checkpoint} harness of {run} is not a harness: {why}")
    model, tokenizer = merged_model(point["folder"])
    model = narrowest_exact(model)
    model.config._name_or_path = tokenizer.name_or_path = "model"  # (not the exporting machine's path)
    config, summary, score = point["config"], point["summary"], point["score"]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp"))
    try:
        model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        (tmp / "harness.py").write_text(point["harness"])
        agent = dict(
            run=run.resolve().name, checkpoint=checkpoint, commit=commit_of(run), method=config.get("method"),
            domain=config.get("domain"), seed=config.get("seed"), base_model=config.get("model"),
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            weights="whole model" if (point["folder"] / "model.safetensors").exists() else
            f"the top {config.get('train_layers')} blocks merged into the base",
            budget=config.get("budget"), rollouts=point["state"].get("rollouts"), chat_format=config.get("chat_format"),
            sampling={k: config.get(k) for k in ("temperature", "top_k", "top_p", "max_tokens")},
            test=None if score is None else dict(split=config.get("test_split", "test"), n=score.get("n"),
                                                 mean=score.get("mean"), se=score.get("se"),
                                                 examples=score.get("examples")),
            test_gain=None if summary is None else dict(gain=summary.get("test_gain"), se=summary.get("test_gain_se")),
            accepted_changes=accepted_changes(run))
        if summary is None:
            agent["warning"] = ("the run had not finished: this is its last checkpoint, at "
                                f"{point['state'].get('rollouts')} of {config.get('budget')} rollouts")
        elif halved_after_scoring(point):
            agent["warning"] = ("the run kept its trained weights in bfloat16 after scoring them in fp32 (a run "
                                "from before that was fixed): this agent may answer some questions otherwise than "
                                "the run's test score says")
        (tmp / "agent.json").write_text(json.dumps(agent, indent=1) + "\n")
        (tmp / "README.md").write_text(readme(agent))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip().splitlines()[0])
    ap.add_argument("run", help="a run directory (python whale.py --out ...)")
    ap.add_argument("out", help="the folder to write (must not exist)")
    ap.add_argument("--checkpoint", choices=("final", "best_val"), default="final",
                    help="the run's last point, or the one chosen on validation")
    ap.add_argument("--unfinished", action="store_true", help="export a run that has not finished (its last checkpoint)")
    ap.add_argument("--to-tracker", action="store_true", help="also log the bundle as the model artifact of the run's "
                    "own --tracker run (MLflow, W&B: tracker.json says which)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    try:
        if a.to_tracker and (out / "agent.json").exists() and \
                read_json(out / "agent.json", "the export").get("run") == Path(a.run).resolve().name:
            print(f"{out} already holds this run's export: logging it only")
        else:
            out = export(a.run, a.out, a.checkpoint, a.unfinished)
    except ExportError as e:
        print(f"export: error: {e}", file=sys.stderr)
        return 2
    agent = json.loads((out / "agent.json").read_text())
    if agent.get("warning"):
        print(f"export: warning: {agent['warning']}", file=sys.stderr)
    print(f"{a.run} ({agent['checkpoint']}) is in {out}/: model/, harness.py, agent.json, README.md")
    if a.to_tracker:
        from rundir import tracking
        try:
            took = tracking.log_bundle(Path(a.run), out)
        except Exception as e:
            print(f"export: error: the tracker did not take the bundle ({type(e).__name__}: {str(e)[:200]}); "
                  f"{out} is whole; the same command again logs it", file=sys.stderr)
            return 2
        print(f"logged to the run's tracker: {', '.join(took)}" if took else
              "export: the run has no tracker run (it ran without --tracker mlflow|wandb): nothing logged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
