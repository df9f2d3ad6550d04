"""
Int8 rollouts on the CPU: a copy of the model whose Linear layers hold int8 weights.

Opt-in (`--rollout-precision int8`, `engine.HFEngine(precision="int8")`): the sampler runs on
`int8_copy(model)`, in which every nn.Linear (attention, MLP, the LM head) is an Int8Linear;
phase A still trains the fp32 model, and HFEngine.sync_weights() rebuilds the copy after each
update. On this machine it gives ~1.8-2.1x fp32's rollouts/s (tools/bench.py --only eval) and a
validation mean@8 within one SE of fp32's (results/README.md, Speed).

What it leaves out: int8 training, an int8 KV cache, int8 embeddings or attention arithmetic
(those stay fp32), GPUs and vLLM (whale.py refuses int8 there: a GPU has bf16 and faster
kernels). Its one cost in results: a request's tokens depend on its batch, because the fp32
attention's round-off over left padding can tip an activation over an int8 rounding step
(engine.py's docstring; test_int8_sampler_is_reproducible_and_close_to_fp32 measures it).
"""
import copy

import torch


class Int8Linear(torch.nn.Module):
    """An nn.Linear for sampling with int8 weights (one scale per output channel) whose input is
    quantized to int8 per row, i.e. per token, at every call; the int8 x int8 product accumulates
    exactly in int32 (torch._int_mm, the kernel torchao's int8 dynamic quantization runs on), then
    one multiply by both scales gives fp32 back. Per row matters twice (measured, see int8_copy):
    a row's output never depends on the other rows of the call (round-off elsewhere still can
    move it: module docstring); and one outlier token (the first token's activations are ~100x
    the rest) does not flatten every other token of a prefill to a few int8 levels."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127  # symmetric, per output channel
        self.register_buffer("weight_int8", (w / scale).round().to(torch.int8))
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]: scales the output columns
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127  # per row: [rows, 1]
        y = torch._int_mm((x / x_scale).round().to(torch.int8), self.weight_int8.t()) * (x_scale * self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1)


def int8_copy(model):
    """A copy of `model` for sampling with every nn.Linear (attention, MLP and the LM head) an
    Int8Linear; the embeddings, norms and attention arithmetic stay fp32, and `model` is not
    touched. Measured on SmolLM2-135M, one loaded core (a 52-token text, next-token
    distributions vs fp32): KL 0.04 nats, argmax kept at 92% of positions; a decode step 2.6x
    (16 rows) to 3.5x (64 rows) faster; building the copy (or re-building it in sync_weights)
    0.6-2.6 s with the machine's load, against minutes of rollouts between two updates.
    torch's own quantize_dynamic was tried first and dropped: it quantizes each input with ONE
    scale for the whole batch, so a row's logits moved by up to 10 with what else was in the
    batch, and prefill outliers cost it KL 1.36, argmax kept at 52%."""
    q = copy.deepcopy(model)
    for parent in list(q.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8Linear(child))
    for p in q.parameters():
        p.requires_grad_(False)  # nothing trains the copy: phase A trains `model`
    return q.eval()
