"""lm/: the language model as the method uses it: loaded, prompted, sampled, saved.

- models.py: where the weights come from (the embedded SmolLM2 GGUF, any local or hub causal LM),
  converted once and cached;
- chat_format.py: a list of messages -> prompt token ids, and what ends a reply;
- engine.py: the HF sampler (batched, temperature/top-k/top-p, stop strings) and its save/load;
  shared_prefix.py (one prompt's cache for its G samples) and int8.py (int8 rollouts) make it
  faster; vllm_engine.py is the same interface over vLLM, imported only when asked for;
- prefix_tree.py: phase A's shared prompt tokens run once in the SFT forward (--sft-prompts shared);
- process_tuning.py: OpenMP's wait and glibc's freed memory, set before torch loads (whale.py's first call).

What it promises the method: `engine.load_engine(model, engine=, device=, ...)` returns an
object whose `.sample(requests)` gives each request's text, token ids and finish reason, with
the model's own token ids kept so that phase A trains on exactly what was sampled; `.model` is a
plain transformers causal LM the optimiser updates in place. What it leaves out: training (rs_sft.py), tensor parallelism beyond
vLLM's own, serving over a network. Nothing here imports the method's files.
"""
