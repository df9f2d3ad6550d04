"""
The fixtures the test files share: the embedded model (hf), tiny whale.py runs made once a session
(tiny_reference, knobs_reference), the tiny harnesses, a local OpenAI-compatible server, the
BIG-bench source distribution; and the hook that keeps the tests of one shared run on one
pytest-xdist worker. Helpers that are plain functions are tests/helpers.py.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning OpenMP threads starve the sandbox
from pathlib import Path

import pytest
import torch

from lm import engine
from lm import models
from tests.helpers import TINY, run_whale, tiny_harness_source, tiny_model, tiny_tokenizer, write_qwen2_gguf


# pytest-xdist (.ci/run: -n 2 --dist loadgroup): a test that takes a session fixture which is a whole
# whale.py run or a download (SHARED_RUNS) runs on the worker of that fixture's group, so the run is
# made once, not once per worker; the tests whose attacks aim at PWNED (/tmp/whale_pwned) share the
# group "pwned". Computed here from each test's fixtures and source: no list kept by hand. (tryfirst:
# xdist's worker reads the marks in its own pytest_collection_modifyitems, which must come after this.)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    import inspect
    import re

    from tests.helpers import SHARED_RUNS
    for item in items:
        shared = sorted(set(getattr(item, "fixturenames", ())) & SHARED_RUNS)
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
        elif re.search(r"\bPWNED\.\w", inspect.getsource(item.function)):  # .exists(), .unlink()...
            item.add_marker(pytest.mark.xdist_group("pwned"))


# ---- the fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def hf():
    torch.manual_seed(0)
    model, tok = models.load_model("embedded")
    return engine.HFEngine(model, tok)


@pytest.fixture(scope="session")
def tiny_harness(tmp_path_factory):
    """tests/helpers.tiny_harness_source() in a file: a harness a tiny run keeps rollouts with."""
    path = tmp_path_factory.mktemp("harness") / "searchqa_good.py"
    path.write_text(tiny_harness_source())
    return str(path)


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory, tiny_harness):
    """One uninterrupted tiny whale run: the reference the crash tests compare against."""
    out = tmp_path_factory.mktemp("ref") / "whale"
    r = run_whale("--domain", "searchqa", "--method", "whale", "--out", str(out), *TINY, "--harness", tiny_harness)
    assert r.returncode == 0, r.stderr[-3000:]
    (out.parent / "stdout.txt").write_text(r.stdout)  # beside the run, not in it
    (out.parent / "stderr.txt").write_text(r.stderr)  # (the progress bars)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{name: what --model gets}: four HF directories and one .gguf file (the weights of qwen2-base)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, arch, style in (("qwen2-chatml", "qwen2", "chatml"), ("qwen2-base", "qwen2", "base"),
                              ("gemma3-turns", "gemma3", "turns"), ("gemma3-base", "gemma3", "base")):
        tok = tiny_tokenizer(style)
        model = tiny_model(arch, tok, seed=len(out))
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = str(root / name)
        if name == "qwen2-base":
            write_qwen2_gguf(model, tok, root / "qwen2-base.gguf")
            out["qwen2-gguf"] = str(root / "qwen2-base.gguf")
    return out
