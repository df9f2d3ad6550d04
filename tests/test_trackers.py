"""
Experiment trackers (rundir/tracking.py): TensorBoard, MLflow and W&B beside metrics.jsonl.
"""
import importlib.util
import json
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from rundir import tracking
from tests.helpers import TINY, run_whale


# ---- experiment trackers (tracking.py): TensorBoard, MLflow, W&B beside metrics.jsonl ----------
# Read back with each backend's own reader: TensorBoard's EventAccumulator, MLflow's MlflowClient on
# the file store, and W&B's own reader of its offline transaction log (`wandb leet inspect --json`).

needs_trackers = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("tensorboard", "mlflow", "wandb")),
                                    reason="the trackers are optional: pip install -r rundir/requirements-track.txt")


def tracker_points(run, backend):
    """Every (name, target rollouts, value) point the backend holds for this run, and the backend's
    record of the end of the run: {summary name: value}, the artifact names."""
    import collections
    points, summary, files = collections.Counter(), {}, set()
    if backend == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()  # every event file in the folder (a resumed run adds one)
        for tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                if tag.startswith("summary/"):
                    summary[tag[8:]] = e.value
                else:
                    points[tag, e.step, e.value] += 1
        files = {t.split("/")[0] for t in acc.Tags()["tensors"]}  # text: config, final_harness
    elif backend == "mlflow":
        from mlflow.tracking import MlflowClient
        client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert len(runs) == 1  # a resume continued the same MLflow run
        rid = runs[0].info.run_id
        assert runs[0].info.status == "FINISHED" and runs[0].data.params["domain"] == "searchqa"
        for key in runs[0].data.metrics:
            for m in client.get_metric_history(rid, key):
                if key.startswith("summary/"):
                    summary[key[8:]] = m.value
                else:
                    points[key, m.step, m.value] += 1
        files = {f.path for f in client.list_artifacts(rid)}
    else:  # wandb: one offline run folder per process that ran it, all with the same run id
        logs = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
        assert len({f.name for f in logs}) == 1
        for log in logs:
            out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr[-2000:]
            for rec in map(json.loads, out.stdout.splitlines()):
                if rec["type"] == "history":
                    item = rec["history"]["item"]
                    for k, v in item.items():
                        if not k.startswith("_") and k != "rollouts":
                            points[k, item["rollouts"], v] += 1
                elif rec["type"] == "summary":
                    summary.update({k[8:]: v for k, v in rec["summary"]["update"].items() if k.startswith("summary/")})
            files |= {p.name for p in log.parent.glob("files/*")}
    return points, summary, files


@needs_trackers
@pytest.mark.slow
def test_trackers_after_sigkill_and_resume_hold_every_metrics_row_once(tmp_path, tiny_harness, monkeypatch):
    """A tiny whale run logging to TensorBoard, MLflow and W&B (offline) is killed (SIGKILL) while
    writing the checkpoint after its first RSFT step, that step already sent, then resumed: each
    backend, read back with its own reader, holds every number of metrics.jsonl exactly once, at
    the target rollouts it was logged at, then the summary numbers, the final harness and the report.
    (W&B offline: what the killed process logged since its service last wrote may be lost, see
    below; no point twice, and everything after the kill.)"""
    import collections

    run, env = tmp_path / "tracked", {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # (--budget 24: one RSFT step, then an iteration of the harness phase ends the run: every kind of row)
    r = run_whale("--domain", "searchqa", "--method", "whale", "--out", str(run), *TINY, "--budget", "24",
                  "--harness", tiny_harness, "--tracker", "tensorboard,mlflow,wandb",
                  env={**env, "WHALE_CRASH_AT": "checkpoint:2"})
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    sent = json.loads((run / "tracker.json").read_text())["sent"]
    kept = json.loads((run / "checkpoint" / "state.json").read_text())["metrics_lines"]
    kept_rows = [x for x in (run / "metrics.jsonl").read_text().splitlines()[:kept]
                 if json.loads(x)["event"] not in tracking.PROCESS_EVENTS]
    assert all(n > len(kept_rows) for n in sent.values()), (sent, kept_rows)  # rows the resume writes again
    r = run_whale("--resume", str(run), env=env)
    assert r.returncode == 0 and "--tracker" not in r.stderr, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(x["event"] == "start" for x in rows) == 2 and any(x["event"] == "rollout_step" for x in rows)
    want = collections.Counter((k, x["rollouts"], v) for x in tracking.read_rows(run)
                               for k, v in tracking.numbers(x).items())
    s = json.loads((run / "summary.json").read_text())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3 asks for it to read a file store)
    for backend in ("tensorboard", "mlflow", "wandb"):
        points, summary, files = tracker_points(run, backend)
        stored = (lambda v: float(np.float32(v))) if backend == "tensorboard" else (lambda v: v)  # TB: float32
        # every point once; and its value, but for wall-clock times (a step the resume ran again took
        # other seconds than the one the tracker got before the kill)
        clock = lambda k: k.endswith(("seconds", "per_s", "rss_mb", "tree_mb"))  # the machine's clock, memory  # noqa: E731
        got = collections.Counter((k, step) for k, step, _ in points.elements())
        if backend == "wandb":
            # W&B's service writes its offline log in blocks: a SIGKILL of the run loses what the killed
            # process logged since its last block (tracking.py's docstring), never a point twice. What
            # the resumed process sent (it ends with wandb.finish, which writes all) must all be there.
            after = collections.Counter((k, x["rollouts"]) for x in tracking.read_rows(run)[sent["wandb"]:]
                                        for k in tracking.numbers(x))
            assert not got - collections.Counter((k, step) for k, step, _ in want.elements()), backend
            assert max(got.values()) == 1 and not after - got, (backend, sorted(after - got)[:5])
            continue
        assert got == collections.Counter((k, step) for k, step, _ in want.elements()), backend
        values = collections.Counter({(k, step, v): n for (k, step, v), n in points.items() if not clock(k)})
        wanted = collections.Counter({(k, step, stored(v)): n for (k, step, v), n in want.items() if not clock(k)})
        assert values == wanted, (backend, sorted(values - wanted)[:5], sorted(wanted - values)[:5])
        for x in rows:  # and by name: the numbers of each kind of row, where a reader of metrics.jsonl expects them
            if x["event"] == "rollout_step":
                assert points["rollout_step/train_reward", x["rollouts"], stored(x["train_reward"])] == 1, backend
            if x["event"] == "eval" and x["tag"] != "best_val":
                assert points[f"eval/{x['split']}/se", x["rollouts"], stored(x["se"])] >= 1, backend
        assert abs(summary["test_mean8_final"] - s["test_mean8_final"]) < 1e-6 and \
            summary["proposer_calls"] == s["proposer_calls"] >= 1, backend
        # the final harness and report.html (TensorBoard has no file artifacts: the harness is a text entry)
        assert {"config", "final_harness"} <= files if backend == "tensorboard" else \
            {"report.html", "final_harness.py"} <= files, (backend, files)


@needs_trackers
@pytest.mark.slow
def test_a_failing_tracker_warns_once_and_the_run_finishes(tmp_path, tiny_harness):
    """Two broken backends in one run: TensorBoard's folder cannot be made (a file is in its way)
    and MLFLOW_TRACKING_URI names a local port nobody listens on. Each is one warning line, the run
    finishes with exit 0 and metrics.jsonl has every row."""
    run = tmp_path / "broken"
    run.mkdir()
    (run / "tensorboard").write_text("in the way")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = run_whale("--domain", "searchqa", "--method", "eval", "--out", str(run), "--test-limit", "2", "--test-n", "1",
                  "--max-tokens", "16", "--harness", tiny_harness, "--tracker", "tensorboard,mlflow",
                  env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"})
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [x for x in r.stderr.splitlines() if "warning: --tracker" in x]
    assert len(warnings) == 2 and "tracker tensorboard failed" in warnings[0] and "tracker mlflow failed" in warnings[1]
    assert all("metrics.jsonl has every row" in w for w in warnings) and "Traceback" not in r.stderr
    assert (run / "summary.json").exists()
    events = [json.loads(x)["event"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e for e in events if e not in tracking.PROCESS_EVENTS] == ["eval"] and events[0] == "start"


@needs_trackers
def test_a_tracker_that_fails_mid_run_is_turned_off_with_one_warning(tmp_path, capsys):
    """A backend that worked when the run opened and then fails (here MLflow's file store is
    deleted under it) is one warning and then silence; tracker.json counts only what it took."""

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    t = tracking.open_tracker(run, {"tracker": "mlflow", "domain": "searchqa"})
    t.log({"event": "eval", "split": "val", "tag": "A0", "mean": 0.5, "se": 0.1, "rollouts": 8})
    shutil.rmtree(run / "mlruns")
    for i in range(3):
        t.log({"event": "eval", "split": "val", "tag": f"A{i + 1}", "mean": 0.5, "se": 0.1, "rollouts": 16 + i})
    t.finish({"rollouts": 32}, "def run(task, llm, tools):\n    return None\n", None)
    err = capsys.readouterr().err
    assert err.count("whale: warning: --tracker mlflow failed") == 1, err
    assert json.loads((run / "tracker.json").read_text())["sent"] == {"mlflow": 1}
