"""One measurement for the CPU and GPU tests of ``compile``: how far compiled and eager
blocks are from each other, and from float32, on the built-in model."""

from __future__ import annotations

import torch

from posttrain.data import pad_sequences
from posttrain.fast.compile import compile_pointwise_blocks
from posttrain.models import completion_logprobs, load_causal_lm


def _logprobs_and_grad(model, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    batch = pad_sequences([[5, 6, 7], [8, 9]] * 2, [[20, 21], [22], [23, 24, 25], [30]], 0)
    batch = {k: v.to(device) for k, v in batch.items()}
    model.zero_grad()
    lp = completion_logprobs(model, batch["input_ids"], batch["attention_mask"],
                             batch["loss_mask"])
    lp.sum().backward()
    return lp.detach().float(), torch.cat([p.grad.float().flatten()
                                           for p in model.parameters()])


def compiled_errors(dtype: str, device: str) -> dict[str, float]:
    """Relative error norms (log-probs ``lp_*``, the whole gradient ``g_*``) of the compiled
    model against eager (``*_vs_eager``), and of each against the float32 model
    (``*_compiled_vs_fp32``, ``*_eager_vs_fp32``)."""
    eager = load_causal_lm("builtin", dtype=dtype, device=device)
    fused = load_causal_lm("builtin", dtype=dtype, device=device)
    assert compile_pointwise_blocks(fused) > 0
    torch._dynamo.reset()  # a fresh compile, so that the counter below means something
    torch._dynamo.utils.counters.clear()
    e, f = _logprobs_and_grad(eager, device), _logprobs_and_grad(fused, device)
    # the compiled blocks really ran (float32 could not tell them from eager otherwise)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    ref = _logprobs_and_grad(load_causal_lm("builtin", device=device), device)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    out = {}
    for i, name in enumerate(("lp", "g")):
        out[f"{name}_vs_eager"] = rel(f[i], e[i])
        out[f"{name}_compiled_vs_fp32"] = rel(f[i], ref[i])
        out[f"{name}_eager_vs_fp32"] = rel(e[i], ref[i])
    return out
