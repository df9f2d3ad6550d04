"""
The model as a sampler: sample from it in batches, save it (models.py loads it; chat_format.py
turns messages into prompt ids and says what ends a reply).

Everything in WHALE is rollouts, so this file is where the time goes. It holds
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
arriving requests into a running decode (the sandbox hands us whole batches; tried, it
saved no forward: results/README.md), a prefix cache kept across sample() calls (a
second turn would start from its first prompt's cache: at most ~17-32% of prefill, for
the whole cache of every first prompt until its second turn, ~3.5 GB for 100 questions
of the long harness; `tools/bench.py --only prefix`),
bf16 or 4-bit sampling (fp32 on CPU: bf16 is ~20x slower on AVX2 machines; a GGUF
file is de-quantised once), int8 on a GPU or under vLLM, remote code
(`trust_remote_code`), and multimodal checkpoints (only the text of a conversation
reaches the model).
"""
import collections
import contextlib
import inspect
import time
from pathlib import Path

import torch

from lm import int8  # the opt-in int8 sampling copy (HFEngine(precision="int8"))
from lm.chat_format import chat_ids, chat_stop_strings, resolve_chat_format, stop_token_ids  # messages -> ids, stops
from lm.models import EMBEDDED, load_model, resolve_model_path, save_atomic  # where the model comes from

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

        def add_rows(self, n):
            # n more (empty) rows after these: a prefill in row slices allocates for its first slice
            self.k_buf = torch.cat([self.k_buf, self.k_buf.new_empty((n, *self.k_buf.shape[1:]))])
            self.v_buf = torch.cat([self.v_buf, self.v_buf.new_empty((n, *self.v_buf.shape[1:]))])
            self.keys, self.values = self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length]

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
    last token).

    The groups are the cheapest cut of the sorted prompts into runs: a group costs its head once
    plus each member's tail, so the prompts of one question's second turn (its first prompt, ~760
    tokens, then a sample's own reply) are one group on that prompt, not one group with other
    questions on the ~380 tokens of instructions they all share, which would re-run every
    question's passages in each tail (measured on 4 questions of the long harness: 5,112
    positions, 2,108 in a whole prefix tree; a head is one level, so this cut sits between).
    Sorting puts prompts with a common head next to each other, and a run's head is the
    smallest common prefix of its neighbours; best[b] is the cheapest cut of the first b."""
    order = sorted(range(len(prompts)), key=lambda j: prompts[j])
    ps = [prompts[j] for j in order]
    lcp = [0] + [common_prefix_len(ps[i - 1], ps[i]) for i in range(1, len(ps))]  # with the one before
    best, start = [0] + [float("inf")] * len(ps), [(0, 0)] * (len(ps) + 1)  # start[b]: its last run's (a, head)
    for b in range(1, len(ps) + 1):
        head, total = len(ps[b - 1]) - 1, 0
        for a in range(b, 0, -1):  # the run ps[a-1 .. b-1] as one group
            total += len(ps[a - 1])
            if a < b:
                head = min(head, lcp[a], len(ps[a - 1]) - 1)
                if head < min_shared:
                    break  # a longer run only shares less
            cost = best[a - 1] + head + total - (b - a + 1) * head
            if cost < best[b]:
                best[b], start[b] = cost, (a, head)
    groups, b = [], len(ps)
    while b:
        a, head = start[b]
        groups.append((head, order[a - 1:b]))
        b = a - 1
    return groups[::-1]


def common_prefix_len(p, q) -> int:
    n, limit = 0, min(len(p), len(q))
    while n < limit and p[n] == q[n]:
        n += 1
    return n


SAMPLERS = ("fast", "landed")
PRECISIONS = ("fp32", "int8")


class HFEngine:
    """Sampler over a transformers causal LM. `.model` is the module phase A trains,
    so a weight update is visible to the next sample() without any copy (with
    precision="int8", once sync_weights() has re-quantized the sampling copy)."""

    def __init__(self, model, tokenizer, max_batch_rows: int = 512, max_batch_tokens: int = 2**17,
                 chat_format: str = "auto", sampler: str = "fast", precision: str = "fp32", shared_prefix: bool = True,
                 max_prefill_tokens: int = 2**15):
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
        # a memory cap of its own (fit_to_memory, --max-memory; None: none): the positions a chunk's
        # cache really holds (with shared_prefix, each prompt's once and each row's new tokens)
        self.max_cache_positions = None
        # distinct prompts sharing a head of at least this many tokens prefill it once
        self.min_shared_head = 64
        # one prefill forward runs at most this many positions (rows x width): its activations and
        # attention scores grow with it (16 rows of 1,000 tokens took 1.1 GB above their cache), and
        # 64 distinct 1,000-token prompts (a long harness's candidate, 2 samples each) in one
        # forward took several GB; more rows than this are prefilled in slices of rows into the
        # same cache. Below it, a forward is what it was (the same batches, the same numbers)
        self.max_prefill_tokens = max_prefill_tokens
        # fast sampler, decode: each prompt's cache kept once for all of its samples, not copied to
        # every row (shared_prefix.py; False copies it as before, for tools/bench.py to compare);
        # architectures it does not cover keep a full cache per row
        from lm import shared_prefix as sp
        self.shared_prefix = shared_prefix and sampler == "fast" and sp.supported(self.sampling_model)
        self.prefill_tokens = 0  # tokens run through prefill so far (what the sharing saves shows here)
        self.on_tokens = None  # called with the number of tokens each decode step samples (rollout.bar)
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

    def _over_memory(self, chunk, requests) -> bool:
        """Whether a chunk's cache would hold more than max_cache_positions (--max-memory): with
        shared_prefix, every prompt padded to the longest once plus each row's new tokens; without,
        every row padded to the longest prompt plus the most new tokens."""
        if self.max_cache_positions is None:
            return False
        width = max(len(p) for p, _ in chunk)
        rows = sum(len(m) for _, m in chunk)
        new = max(int(requests[i]["max_tokens"]) for _, m in chunk for i in m)
        held = len(chunk) * width + rows * new if self.shared_prefix else rows * (width + new)
        return held > self.max_cache_positions

    def _tail_buckets(self, tail_lens):
        """[(r0, r1)]: runs of rows (tails sorted by length) prefilled by one forward each. The
        landed sampler does all rows in one forward, padded to the longest tail; the fast one
        starts a new run where a tail is over 1.25x the run's shortest (so a run pads at most
        ~20%; h0's 64 searchqa tails pad ~19% as one run, the long harness's ~31%)."""
        if self.sampler == "landed":
            return [(0, len(tail_lens))]
        runs, r0 = [], 0
        for r, n in enumerate(tail_lens):
            if n > 1.25 * tail_lens[r0] + 8 or (r + 1 - r0) * n > self.max_prefill_tokens:
                runs.append((r0, r))
                r0 = r
        return runs + [(r0, len(tail_lens))]

    def _prefill_slices(self, rows, width):
        """[(r0, r1)]: the rows of the heads' prefill, at most max_prefill_tokens positions a forward
        (the landed sampler: all rows in one, as it was)."""
        step = rows if self.sampler == "landed" else max(1, self.max_prefill_tokens // max(width, 1))
        return [(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]

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
                          or (rows + len(members)) * max(width, need) > self.max_batch_tokens
                          or self._over_memory(chunk + [(prompt, members)], requests)):
                self._sample_chunk(requests, chunk, results)
                chunk, rows, width = [], 0, 0
            chunk.append((prompt, members))
            rows, width = rows + len(members), max(width, need)
        if chunk:
            self._sample_chunk(requests, chunk, results)
        return results

    @torch.no_grad()
    def _sample_chunk(self, requests, chunk, results):
        from lm import shared_prefix  # (transformers is imported lazily here, as by the loaders)
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
        head_logits = []
        for r0, r1 in self._prefill_slices(len(heads), width):
            if r0 == 0:  # the first slice allocates the cache's buffers: for its own rows, then for all
                part = cache
            else:
                part = preallocated_cache(model, 0)
                part.layers = [layer.row_range(r0, r1, 0) for layer in cache.layers]
            out = model(input_ids=ids[r0:r1].to(dev), attention_mask=mask[r0:r1].to(dev),
                        position_ids=pos[r0:r1].to(dev), use_cache=True, logits_to_keep=1, **{self.cache_kw: part})
            head_logits.append(out.logits[:, -1, :])
            if r0 == 0 and r1 < len(heads):
                for layer in cache.layers:
                    layer.add_rows(len(heads) - r1)
            work["prefill_forwards"] += 1
        for layer in cache.layers:  # (the views wrote the other slices' positions into the same buffers)
            layer.keys, layer.values = layer.k_buf[:, :, :layer.length], layer.v_buf[:, :, :layer.length]
        self.prefill_tokens += sum(map(len, heads))
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
            last_logits = torch.cat(head_logits)
            row_of = {j: j for j in range(len(prompts))}
        # 2) one row per request: its prompt's last logits, and its prompt's cache: copied to every
        #    member row, or (shared) kept once per prompt beside a cache of each row's own new tokens
        order = [i for _, members in chunk for i in members]
        src = torch.tensor([row_of[j] for j, (_, members) in enumerate(chunk) for _ in members], dtype=torch.long)
        logits = last_logits.float()[src.to(dev)]
        # the prefill's last output and cache views go: only the cache may hold the prompts' keys and
        # values, or SharedPrefix.keep_rows could not free them as it compacts
        del out, part, layer
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
                sampled = 0
                for k, t in zip(rows, tok):
                    if finish[k] is not None:
                        continue  # finished earlier, not compacted away yet: its token is thrown away
                    generated[k].append(t)
                    sampled += 1
                    if t in self.eos_ids:
                        finish[k] = "eos"
                    elif stops[k] and any(s in self.tokenizer.decode(generated[k][-tails[k]:]) for s in stops[k]):
                        finish[k] = "stop"
                    elif len(generated[k]) >= max_new[k]:
                        finish[k] = "length"
                if self.on_tokens is not None:
                    self.on_tokens(sampled)
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


def kv_bytes_per_position(engine) -> int:
    """The bytes one position of the sampler's KV cache takes, read off a one-token forward. That
    forward also touches every weight: a model loaded from safetensors is mapped, not read, so
    until a first forward its weights are not in RSS (measured: 440 -> 945 MB for the 135M model)."""
    model = engine.sampling_model
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[engine.pad_id]], device=engine.device), use_cache=True)
    cache = out.past_key_values
    layers = getattr(cache, "layers", None) or []
    return sum(t.nbytes for layer in layers for t in (layer.keys, layer.values) if t is not None) or \
        sum(k.nbytes + v.nbytes for k, v in cache)  # (an older transformers' tuple of (keys, values))


def fit_to_memory(engine, gb: float, reserved_bytes: int, per_position: int = 0) -> dict:
    """--max-memory: size the HF sampler so that the process stays near `gb` GiB. What is left after
    reserved_bytes (the weights, the optimizer state to come, the rest of the process) goes half to
    one chunk's KV cache (max_cache_positions: the positions the cache really holds, a prompt's
    once under shared_prefix, at per_position bytes: kv_bytes_per_position) and half
    to one prefill forward's activations (max_prefill_tokens at an estimate per position: fp32
    attention scores of a ~1,000-token prompt, the MLP and the residual stream; 100 KB for the 135M
    model, 70 KB measured). Smaller batches are slower, not different: the same tokens
    (tests/test_sampler.py). Below the smallest caps (256 MB left) it keeps those and says so."""
    free = gb * 2**30 - reserved_bytes
    per_position = per_position or kv_bytes_per_position(engine)
    model = engine.sampling_model
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    activations = 4 * (2 * c.num_attention_heads * 1024 + 3 * c.intermediate_size + 4 * c.hidden_size)
    engine.max_cache_positions = max(4096, int(max(free, 2**28) / 2 / per_position))
    engine.max_prefill_tokens = max(1024, int(max(free, 2**28) / 2 / activations))
    return {"max_cache_positions": engine.max_cache_positions, "max_prefill_tokens": engine.max_prefill_tokens,
            "kv_bytes_per_position": per_position, "reserved_gb": round(reserved_bytes / 2**30, 2),
            "too_small": free < 2**28}


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
        from lm.vllm_engine import VLLMEngine
        return VLLMEngine(resolve_model_path(model), tokenizer, hf_model, tp=tp, seed=seed, chat_format=chat_format)
    raise ValueError(f"unknown engine {engine!r} (choose hf or vllm)")
