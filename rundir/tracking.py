"""
Experiment tracking beside metrics.jsonl: `--tracker tensorboard`, `mlflow`, `wandb` or a comma
list of them (default none). Each backend goes through its official client, imported only when
chosen (pip install -r rundir/requirements-track.txt).

What a tracker gets: the run's config as parameters; every metrics.jsonl row that has numbers
(rollout steps, evaluations with their SE, harness candidates and iterations, ...), each field
named <event>/<field> (an evaluation: eval/<split>/<field>), plotted against the target rollouts
the run had spent when it was written; at the end the summary.json numbers (summary/<name>,
proposer calls, tokens and cost among them), the final harness and report.html.
(A harness phase books its rollouts when it ends, so its events share one x value; their
`iteration` field orders them.)

Local by default, no account needed:
  tensorboard  event files in <run>/tensorboard    (tensorboard --logdir runs)
  mlflow       a file store in <run>/mlruns, or MLFLOW_TRACKING_URI when it is set
  wandb        its own environment decides (WANDB_MODE=offline: files in <run>/wandb, no network)

Resume: <run>/tracker.json holds the tracker run's id and, per backend, how many metrics rows
it has been sent. A resumed run reopens the same tracker run, and the rows it writes again
(those after the last checkpoint, replayed with the same seeds) are not sent twice. Rows are
counted without the rows a process writes as it starts (PROCESS_EVENTS), the only ones a resume
adds. A replayed row keeps the values first sent (its wall-clock fields, e.g. sft_seconds, may
differ in metrics.jsonl). (A kill in the
instant between a backend taking a row and tracker.json recording it could repeat that row.)
W&B's client hands rows to a service process that writes them in blocks: a kill -9 of the run
can lose the rows logged since its last write (never a point twice); TensorBoard and MLflow
are on disk before a row counts as sent.

A tracker never stops a run: an exception from a backend is one warning line and that backend is
off for the rest of this process; metrics.jsonl stays the record results.py and report.py read.
Left out: system metrics, model checkpoints as artifacts, other trackers.
"""
import hashlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path

# backend -> (the module it imports, the package that provides it)
BACKENDS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow-skinny"),
            "wandb": ("wandb", "wandb")}


def parse(spec: str) -> list[str]:
    """'tensorboard,wandb' -> ['tensorboard', 'wandb']; 'none' or '' -> []."""
    names = [n.strip() for n in spec.split(",") if n.strip() and n.strip() != "none"]
    return list(dict.fromkeys(names))


def setup_error(spec: str) -> str | None:
    """Why --tracker SPEC cannot run here (an unknown name, a package not installed), else None."""
    import importlib.util
    for name in parse(spec):
        if name not in BACKENDS:
            return f"unknown --tracker {name!r}; choose none, {', '.join(BACKENDS)} (or a comma list)"
    for name in parse(spec):
        module, package = BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            return f"--tracker {name} needs the {package} package: pip install {package} " \
                   f"(or pip install -r rundir/requirements-track.txt)"
    return None


def numbers(row: dict) -> dict[str, float]:
    """The finite numbers of one metrics.jsonl row, named for a tracker (booleans as 0/1; a
    harness candidate's status as <event>/ok). The x value, `rollouts`, and the wall clock `t`
    are not among them."""
    event = row["event"]
    prefix = f"eval/{row['split']}" if event == "eval" else event
    if event == "eval" and row.get("tag") == "best_val":  # the best-on-val checkpoint, scored at the end
        prefix += "_best_val"
    out = {}
    for k, v in row.items():
        if isinstance(v, bool):
            v = int(v)
        if k not in ("t", "rollouts") and isinstance(v, (int, float)) and math.isfinite(v):
            out[f"{prefix}/{k}"] = float(v)
    if "status" in row:
        out[f"{prefix}/ok"] = float(row["status"] == "ok")
    return out


# the rows every process writes as it starts, a resumed one too: which code runs (start) and the caps
# it fitted to the machine's memory (memory_fit); not sent, so that the other rows keep their indices
PROCESS_EVENTS = ("start", "memory_fit")


def read_rows(run: Path) -> list[dict]:
    """metrics.jsonl without its PROCESS_EVENTS rows: the sequence a resume reproduces row for row."""
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r["event"] not in PROCESS_EVENTS]


# -----------------------------------------------------------------------------
# The backends: each open_* returns (log(values, step), finish(summary, harness_source, report_path))

def open_tensorboard(run: Path, args: dict, run_id: str, saved: dict):
    from torch.utils.tensorboard import SummaryWriter
    new = not (run / "tensorboard").exists()
    writer = SummaryWriter(str(run / "tensorboard"))  # a resumed run adds an event file; TensorBoard joins them
    if new:
        table = "\n".join(f"| {k} | {v} |" for k, v in args.items())
        writer.add_text("config", "| parameter | value |\n|---|---|\n" + table)

    def log(values, step):
        for k, v in values.items():
            writer.add_scalar(k, v, step)
        writer.flush()  # on disk before tracker.json counts the row as sent (a kill -9 loses no buffer)

    def finish(summary, harness, report):
        for k, v in summary.items():
            writer.add_scalar(f"summary/{k}", v, int(summary.get("rollouts", 0)))
        writer.add_text("final_harness", "```python\n" + harness + "\n```")  # (no file artifacts in TensorBoard)
        writer.close()
    return log, finish


def open_mlflow(run: Path, args: dict, run_id: str, saved: dict):
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # a dead server costs seconds, not minutes
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:  # the local file store (MLflow 3 keeps it in maintenance mode: it asks for this opt-in)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = (run / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=uri)
    mlflow_id = saved.get("mlflow_run_id")
    if mlflow_id:
        client.get_run(mlflow_id)  # the same run again (raises if this store does not hold it)
        client.update_run(mlflow_id, status="RUNNING")
    else:
        exp = client.get_experiment_by_name("whale") or client.get_experiment(client.create_experiment("whale"))
        tags = {"whale.run_id": run_id, "whale.run_dir": str(run.resolve())}
        mlflow_id = client.create_run(exp.experiment_id, run_name=run.name, tags=tags).info.run_id
        saved["mlflow_run_id"] = mlflow_id
        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in args.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            client.log_batch(mlflow_id, params=params[i:i + 100])

    def ms():
        return int(time.time() * 1000)

    def log(values, step):
        client.log_batch(mlflow_id, metrics=[Metric(k, v, ms(), step) for k, v in values.items()])

    def finish(summary, harness, report):
        step = int(summary.get("rollouts", 0))
        client.log_batch(mlflow_id, metrics=[Metric(f"summary/{k}", v, ms(), step) for k, v in summary.items()])
        client.log_text(mlflow_id, harness, "final_harness.py")
        if report:
            client.log_artifact(mlflow_id, str(report))
        client.set_terminated(mlflow_id)
    return log, finish


def open_wandb(run: Path, args: dict, run_id: str, saved: dict):
    import wandb
    # resume="allow": the same id continues the same run; console="off": our stdout stays ours
    wb = wandb.init(project=os.environ.get("WANDB_PROJECT", "whale"), id=run_id, name=run.name, resume="allow",
                    dir=str(run), config=args, settings=wandb.Settings(console="off"))
    wb.define_metric("rollouts")
    wb.define_metric("*", step_metric="rollouts")  # the x axis of every chart: target rollouts spent

    def log(values, step):
        wb.log({**values, "rollouts": step})

    def finish(summary, harness, report):
        wb.summary.update({f"summary/{k}": v for k, v in summary.items()})
        (Path(wb.dir) / "final_harness.py").write_text(harness)  # wb.dir: the files this run uploads
        wb.save(str(Path(wb.dir) / "final_harness.py"), base_path=wb.dir, policy="now")
        if report:
            wb.save(str(report), base_path=str(report.parent), policy="now")
        wb.finish()
    return log, finish


OPEN = {"tensorboard": open_tensorboard, "mlflow": open_mlflow, "wandb": open_wandb}


# -----------------------------------------------------------------------------
# The run's handle: Run.log calls log(row), Run.finish_tracker calls finish(...)

class Tracker:
    """The chosen backends of one run. Any exception from a backend turns it off with one warning."""

    def __init__(self, run: Path, args: dict):
        self.run, self.path = run, run / "tracker.json"
        try:
            self.saved = json.loads(self.path.read_text()) if self.path.exists() else {}
        except ValueError:  # damaged from outside: the bookkeeping starts over
            print(f"whale: warning: {self.path} is corrupt; the trackers get every row again", file=sys.stderr)
            self.saved = {}
        # the tracker run's id: from the run directory and its config, kept here so a resume finds it
        digest = hashlib.sha256((str(run.resolve()) + json.dumps(args, sort_keys=True)).encode()).hexdigest()
        self.saved.setdefault("id", re.sub(r"[^A-Za-z0-9_-]", "-", run.name)[:48] + "-" + digest[:8])
        self.saved.setdefault("sent", {})
        rows = read_rows(run)  # (a resume has cut metrics.jsonl back to its checkpoint by now)
        self.rows = len(rows)  # the metrics rows (no PROCESS_EVENTS) this process continues from
        self.backends = {}
        for name in parse(args.get("tracker") or "none"):
            fns = self.guard(name, OPEN[name], run, args, self.saved["id"], self.saved)
            if fns:
                self.backends[name] = fns
        for name in list(self.backends):  # rows a backend has not seen: a tracker added on --resume,
            for row in rows[self.saved["sent"].get(name, 0):]:  # or a kill between writing and sending
                self.send(name, row)
        self.save()

    def guard(self, name, fn, *a):
        try:
            return fn(*a)
        except Exception as e:  # a tracker never stops a run: metrics.jsonl has everything
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            print(f"whale: warning: --tracker {name} failed ({type(e).__name__}: {msg}); it is off for the "
                  f"rest of this run, metrics.jsonl has every row", file=sys.stderr, flush=True)
            self.backends.pop(name, None)
            return None

    def send(self, name, row):
        if name not in self.backends:  # turned off by an earlier failure
            return
        values = numbers(row)
        if values:
            self.guard(name, self.backends[name][0], values, int(row["rollouts"]))
        if name in self.backends:  # (a row without numbers counts as sent too: the counts stay row indices)
            self.saved["sent"][name] = self.saved["sent"].get(name, 0) + 1

    def log(self, row: dict):
        """One metrics.jsonl row just written: to every backend that has not had it yet."""
        if row["event"] in PROCESS_EVENTS:
            return
        self.rows += 1
        for name in list(self.backends):
            if self.saved["sent"].get(name, 0) < self.rows:  # else: sent before a kill, now replayed
                self.send(name, row)
        self.save()

    def save(self):
        try:  # atomic: a kill leaves the old file or the new one (run_dir.write_json's way; no import back up)
            tmp = Path(self.path).with_name(f".{Path(self.path).name}.tmp")
            tmp.write_text(json.dumps(self.saved, indent=1, default=str))
            os.replace(tmp, self.path)
        except OSError as e:  # (a full disk: metrics.jsonl will say so; a tracker does not stop the run)
            print(f"whale: warning: {self.path} not written ({e}); a resume may send some points twice",
                  file=sys.stderr)

    def finish(self, summary: dict, harness: str, report: Path | None):
        """The end of the run: summary numbers, the final harness source and report.html; close."""
        nums = {k: float(v) for k, v in summary.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for name in list(self.backends):
            self.guard(name, self.backends[name][1], nums, harness, report)
        self.backends = {}


def log_bundle(run: Path, folder: Path) -> list[str]:
    """An exported agent (tools/export.py) logged as the model artifact of the run's own tracker run
    (tracker.json says which): MLflow, the folder's files under `agent/` of that run; W&B, an
    artifact of type "model" in the resumed run. Returns the backends that took it; a backend the
    run did not use is skipped, one that fails raises (export turns it into one line)."""
    try:
        saved = json.loads((run / "tracker.json").read_text())
    except (OSError, ValueError):
        return []
    done = []
    if saved.get("mlflow_run_id"):
        from mlflow.tracking import MlflowClient
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run / "mlruns").resolve().as_uri()
        MlflowClient(tracking_uri=uri).log_artifacts(saved["mlflow_run_id"], str(folder), artifact_path="agent")
        done.append("mlflow")
    if (run / "wandb").is_dir() and saved.get("id"):
        import wandb
        wb = wandb.init(project=os.environ.get("WANDB_PROJECT", "whale"), id=saved["id"], resume="allow", dir=str(run),
                        settings=wandb.Settings(console="off"))
        artifact = wandb.Artifact(f"{saved['id']}-agent", type="model")
        artifact.add_dir(str(folder))
        wb.log_artifact(artifact)
        wb.finish()
        done.append("wandb")
    return done


def open_tracker(run: Path, args: dict) -> Tracker | None:
    """The run's tracker, or None for --tracker none (then nothing here is imported)."""
    return Tracker(run, args) if parse(args.get("tracker") or "none") else None
