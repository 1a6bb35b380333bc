"""The policy's weights as a stream of (Hugging Face name, tensor): what a rollout engine
with weights of its own (vLLM, a sharded run's plain copy) receives at a sync. The stream is
lazy and yields one whole tensor at a time, so a sharded (FSDP2) model is gathered a piece at
a time and no rank holds a second full copy of the policy to send it; an adapted (LoRA)
model's adapted layers arrive merged, ``W + (α/r)·B·A``, under the base model's names.

Every rank of a sharded model must consume the stream in step (each tensor is a
collective)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from posttrain.sharding import full_tensor


def _merged_linear(m) -> torch.Tensor:
    w = full_tensor(m.base_layer.weight.detach())
    merged = w.clone()
    for a in m.active_adapters:
        if a in m.lora_A:
            delta = (full_tensor(m.lora_B[a].weight.detach())
                     @ full_tensor(m.lora_A[a].weight.detach()))
            merged += (delta.T if m.fan_in_fan_out else delta).to(w.dtype) * m.scaling[a]
    return merged


def _adapted(model) -> Iterator[tuple[str, torch.Tensor]]:
    base = model.get_base_model()
    done: set[str] = set()
    for name, m in base.named_modules():
        prefix = f"{name}." if name else ""
        if hasattr(m, "lora_A") and hasattr(m, "base_layer"):
            yield f"{prefix}weight", _merged_linear(m)
            if getattr(m.base_layer, "bias", None) is not None:
                yield f"{prefix}bias", full_tensor(m.base_layer.bias.detach())
            done.add(prefix)
        elif hasattr(m, "modules_to_save") and hasattr(m, "original_module"):
            active = m.modules_to_save[m.active_adapters[0]]
            for k, v in active.named_parameters():
                yield f"{prefix}{k}", full_tensor(v.detach())
            done.add(prefix)
    for name, p in base.named_parameters():
        if any(name.startswith(d) for d in done) or ".lora_" in name:
            continue
        yield name, full_tensor(p.detach())


def hf_weights(model, dtype: torch.dtype | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s parameters as (name, whole tensor), one at a time (see the module
    docstring), on the CPU in ``dtype`` (the parameter's own when None). Tied weights come
    once, under the first name that holds them (``named_parameters`` lists a shared
    parameter once)."""
    from posttrain.models.lora import is_adapted

    source = _adapted(model) if is_adapted(model) else (
        (n, full_tensor(p.detach())) for n, p in model.named_parameters())
    for name, t in source:
        yield name, t.to("cpu", dtype or t.dtype).contiguous()
