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


def text_config(model):
    """The language model's config (the base's for an adapted model; the text part of a
    multimodal one)."""
    from posttrain.models.lora import is_adapted

    config = (model.get_base_model() if is_adapted(model) else model).config
    return getattr(config, "get_text_config", lambda: config)()


def checkpoint_layout(model, weights: Iterator[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream of ``model``'s weights (its modules' names and shapes) in the layout its
    checkpoints are saved in, what a serving engine's loader reads: ``transformers``
    converts some families' checkpoints when it loads them (a mixture of experts' per-expert
    ``w1``/``w3``/``w2`` into fused ``gate_up_proj``/``down_proj`` tensors) and reverts the
    conversion when it saves; this applies its own revert (``revert_weight_conversion``) a
    tensor at a time, so a fused tensor is streamed as its experts' tensors."""
    from transformers.core_model_loading import revert_weight_conversion

    from posttrain.models.lora import is_adapted

    base = model.get_base_model() if is_adapted(model) else model
    for name, t in weights:
        yield from revert_weight_conversion(base, {name: t}).items()


def _adapted(model, changed_only: bool, merged: bool = True
             ) -> Iterator[tuple[str, torch.Tensor]]:
    from posttrain.models.lora import merged_weight

    base = model.get_base_model()
    done: set[str] = set()
    for name, m in base.named_modules():
        prefix = f"{name}." if name else ""
        if hasattr(m, "lora_A") and hasattr(m, "base_layer"):
            yield f"{prefix}weight", (merged_weight(m) if merged
                                      else full_tensor(m.base_layer.weight.detach()))
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
        if not changed_only or p.requires_grad:
            yield name, full_tensor(p.detach())


def hf_weights(model, dtype: torch.dtype | None = None, changed_only: bool = False,
               merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s parameters as (name, whole tensor), one at a time (see the module
    docstring), on the CPU in ``dtype`` (the parameter's own when None). Tied weights come
    once, under the first name that holds them (``named_parameters`` lists a shared
    parameter once). ``changed_only``: only what training can change (the merged adapted
    layers and the trainable parameters), for a receiver that already holds the rest; a
    frozen base is then not gathered at every sync. ``merged=False``: an adapted model's
    base weights, adapters left out (for a receiver that applies the adapter itself)."""
    from posttrain.models.lora import is_adapted

    source = _adapted(model, changed_only, merged) if is_adapted(model) else (
        (n, full_tensor(p.detach())) for n, p in model.named_parameters()
        if not changed_only or p.requires_grad)
    for name, t in source:
        yield name, t.to("cpu", dtype or t.dtype).contiguous()
