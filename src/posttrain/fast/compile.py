"""``torch.compile`` of the pointwise blocks (RMSNorm, dense MLPs) of the trained models,
behind the ``compile`` key."""

from __future__ import annotations

import torch

from posttrain.config import ConfigError
from posttrain.models.loading import moe_experts


def compile_unsupported(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device`` here, or None when it can."""
    import importlib.util
    import shutil

    if device.type == "cpu":
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return "no C++ compiler on PATH (torch.compile builds its CPU kernels with one)"
        try:  # a compiler alone is not enough (Python headers, OpenMP): build one kernel now
            torch.compile(lambda x: (x * 2).sin(), dynamic=False)(torch.ones(4))
        except Exception as e:  # any build failure, reported instead of failing mid-run
            return f"a trial torch.compile failed on this machine: {e}"
        return None
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "triton is not installed"
    return f"torch.compile is not supported here on {device.type}"

def compile_pointwise_blocks(model: torch.nn.Module) -> int:
    """Compile, in place and for dynamic shapes, every RMSNorm and MLP block of ``model``.

    These blocks are pure tensor functions in ``transformers``' model code (no cache, no
    mask), and most of their time on a CPU is memory-bound elementwise work — the norm's six
    ops, SiLU times up — in the forward and again in the backward, which the compiled
    kernels fuse. Attention, rotary embeddings and the cache stay in eager code. Parameters,
    ``state_dict`` keys and saved files are unchanged; values and gradients match eager to
    float rounding (tested). In a mixture-of-experts model only the norms are compiled: its
    expert MLPs (``Qwen2MoeMLP``, say) run on a data-dependent number of tokens each, a
    recompile or a graph break per routing, and the router's block is no pure MLP. Returns
    the number of modules compiled (already compiled ones are left alone).
    """
    n, moe = 0, moe_experts(getattr(model, "config", None)) is not None
    for module in model.modules():
        name = type(module).__name__
        if not (name.endswith("RMSNorm") or (name.endswith("MLP") and not moe)):
            continue
        if getattr(module, "_compiled_call_impl", None) is None:
            module.compile(dynamic=True)
            n += 1
    return n
def compile_models(cfg, models: list, device: torch.device) -> bool:
    """Apply ``cfg.compile`` to ``models`` (None entries skipped): their RMSNorm and MLP blocks
    are compiled in place (:func:`compile_pointwise_blocks`)."""
    if not cfg.compile:
        return False
    reason = compile_unsupported(device)
    if reason is not None:
        raise ConfigError(f"compile=true: {reason}")
    models = [m for m in models if m is not None]
    for model in models:
        compile_pointwise_blocks(model)
    print(f"torch.compile: RMSNorm and MLP blocks of {len(models)} model(s); they compile on "
          "first use, then run fused", flush=True)
    return True
