"""LoRA adapters through peft (``--lora_rank R``): the trained model is its frozen base plus
low-rank updates ``W + (α/r)·B·A`` on the decoder blocks' linear layers (by default every
one of them), and the optimiser holds only A, B (and a reward model's scalar head).

- **The reference is the base**: the policy with its adapter switched off
  (:func:`adapter_off`), so GRPO's KL, PPO's reward KL and DPO's reference need no second
  copy of the weights.
- **Sampling runs on merged weights.** Unsharded, the policy itself is the sampler: the
  lean decoder (``posttrain.fast.lean``) builds ``W + (α/r)·B·A`` into its per-call fused
  weights, so decoding computes no adapter products and no copy outlives the rollout, and
  the first update replays the sampled projections' outputs with the adapters' gradients
  (``posttrain.fast.replay``). Under fsdp the sampler is :func:`plain_copy`, made before
  sharding: it keeps the frozen weights whole (the policy then holds only its shards) and
  owns the adapted layers, set from the gathered W, A and B after every step
  (:func:`merge_into`).
- Checkpoints and ``final/`` hold the adapter in peft's format (``adapter_config.json``,
  ``adapter_model.safetensors``); :func:`merge` writes a plain Hugging Face model.
- **An adapter directory is a model** wherever one is asked for (``eval --model``, every
  trainer's ``--model``, a reference, a reward model): it loads as its base with the adapter
  merged in (``posttrain.models.loading``). A LoRA run from one trains a fresh adapter of
  rank ``lora_rank`` on that merged start, so the adapter-off reference is the start (not
  the first adapter's base), and any rank may follow any other; its adapter names the
  starting adapter's directory as its base, so it loads as base + both adapters.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from pathlib import Path

import torch

from posttrain.models.loading import LoRAError, decoder_layers, require_peft


def wanted(cfg) -> bool:
    return getattr(cfg, "lora_rank", 0) > 0


def is_adapted(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def linear_targets(model, spec: str = "all-linear") -> list[str]:
    """The module names LoRA adapts: with ``all-linear`` every ``nn.Linear`` inside the
    decoder layers (by their last name: ``q_proj``, ``down_proj``, ...), else the
    comma-separated names of ``spec``, each checked to exist there."""
    found = sorted({name.rsplit(".", 1)[-1] for layer in decoder_layers(model)
                    for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)})
    if spec in ("", "all-linear"):
        return found
    asked = [s.strip() for s in spec.split(",") if s.strip()]
    missing = [s for s in asked if s not in found]
    if missing:
        raise LoRAError(f"lora_targets: {', '.join(missing)} is not a linear layer of the "
                        f"decoder blocks; they have {', '.join(found)}")
    return asked


def add(model, cfg, heads: tuple[str, ...] = ()):
    """``model`` with fresh adapters (B = 0, so it computes what the base does); ``heads``
    (a reward model's score) stay fully trainable and are saved with the adapter."""
    peft = require_peft()
    rank = cfg.lora_rank
    config = peft.LoraConfig(r=rank, lora_alpha=cfg.lora_alpha or 2 * rank,
                             lora_dropout=cfg.lora_dropout,
                             target_modules=linear_targets(model, cfg.lora_targets),
                             modules_to_save=list(heads) or None, bias="none")
    return peft.get_peft_model(model, config)


def load(model, path: str | Path, trainable: bool = True):
    """The base ``model`` with the adapter saved at ``path`` (a checkpoint or ``final/``)."""
    peft = require_peft()
    return peft.PeftModel.from_pretrained(model, str(path), is_trainable=trainable)


def load_4bit(name: str, device: torch.device, trust_remote_code: bool = False):
    """QLoRA's base: ``name`` quantised to 4-bit NF4 by bitsandbytes on a CUDA device,
    computing in bfloat16, prepared for adapter training."""
    if device.type != "cuda":
        raise LoRAError("load_in_4bit (QLoRA) needs a CUDA device (bitsandbytes' 4-bit "
                        f"kernels), not {device}; on the CPU use lora_rank alone")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise LoRAError("load_in_4bit needs bitsandbytes: pip install 'posttrain[qlora]'") \
            from None
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from posttrain.models.loading import check_causal_lm, resolve

    path = resolve(name)
    check_causal_lm(name, AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=torch.bfloat16,
        device_map={"": device.index or 0}, trust_remote_code=trust_remote_code)
    return require_peft().prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def adapter_off(model):
    """A context in which an adapted model computes its base (the frozen reference);
    nothing for a model without adapters."""
    return model.disable_adapter() if is_adapted(model) else nullcontext()


def plain_copy(model):
    """A plain model of the same architecture for the sampler: the adapted model's base with
    the adapters merged in (see :func:`merge_into`). Only what changes in training gets
    storage of its own, the adapted layers' weights (which hold ``W + (α/r)·B·A``) and the
    trainable heads; every weight LoRA leaves frozen (embeddings, norms, the LM head: at a
    150k-token vocabulary most of the model) is the base's own tensor, shared."""
    base = model.get_base_model()
    own = set()
    for m in base.modules():
        if hasattr(m, "lora_A") and hasattr(m, "base_layer"):
            own.update(id(p) for p in m.base_layer.parameters())
        elif hasattr(m, "modules_to_save"):
            own.update(id(p) for p in m.parameters())
    memo = {id(p): p for p in base.parameters() if id(p) not in own and not p.requires_grad}
    plain = copy.deepcopy(base, memo)
    _unwrap(plain)
    merge_into(plain, model)
    return plain


def _unwrap(model) -> None:
    """Replace each peft LoRA layer inside ``model`` by its base layer (in place)."""
    for name, m in list(model.named_modules()):
        base = getattr(m, "base_layer", None)
        if base is not None and hasattr(m, "lora_A"):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, base)
        original = getattr(m, "original_module", None)  # a modules_to_save wrapper
        if original is not None and hasattr(m, "modules_to_save"):
            parent, _, attr = name.rpartition(".")
            active = m.modules_to_save[m.active_adapter if isinstance(m.active_adapter, str)
                                       else m.active_adapter[0]]
            setattr(model.get_submodule(parent) if parent else model, attr, active)


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A parameter's full value: an FSDP2 shard (DTensor) gathered (collective), any other
    tensor as it is."""
    x = x.detach()
    return x.full_tensor() if hasattr(x, "full_tensor") else x


@torch.no_grad()
def merged_weight(m) -> torch.Tensor:
    """An adapted linear layer's ``W + (α/r)·B·A`` over its active adapters, whole (a
    sharded layer is gathered: collective)."""
    w = _whole(m.base_layer.weight)
    merged = w.clone()
    for a in m.active_adapters:
        if a in m.lora_A:
            delta = _whole(m.lora_B[a].weight) @ _whole(m.lora_A[a].weight)
            merged += (delta.T if m.fan_in_fan_out else delta).to(w.dtype) * m.scaling[a]
    return merged


@torch.no_grad()
def merge_into(plain, adapted) -> None:
    """Set each adapted linear layer of the plain copy to ``W + (α/r)·B·A`` (and copy the
    trainable heads), from the adapted model's current adapters. A sharded (FSDP2) adapted
    model is gathered one tensor at a time: every rank calls this."""
    target = dict(plain.named_modules())
    for name, m in adapted.get_base_model().named_modules():
        if hasattr(m, "lora_A") and hasattr(m, "base_layer"):
            target[name].weight.copy_(merged_weight(m))
        elif hasattr(m, "modules_to_save") and hasattr(m, "original_module"):
            active = m.modules_to_save[m.active_adapters[0]]
            target[name].load_state_dict({k: _whole(v) for k, v in
                                          active.state_dict().items()})


def merge(adapter_dir: str | Path, output: str | Path, dtype: str = "float32",
          trust_remote_code: bool = False) -> Path:
    """A plain Hugging Face model at ``output``: the base named in the adapter's config with
    the adapter of ``adapter_dir`` merged in (``posttrain merge``), and the adapter's
    tokenizer (else its base's)."""
    from posttrain.models.loading import load_causal_lm, load_tokenizer, save_model

    merged = load_causal_lm(str(adapter_dir), dtype, "cpu", trust_remote_code)
    save_model(merged, load_tokenizer(str(adapter_dir), trust_remote_code), output)
    return Path(output)


__all__ = [
    "LoRAError",
    "adapter_off",
    "add",
    "is_adapted",
    "linear_targets",
    "load",
    "merge",
    "merge_into",
    "merged_weight",
    "plain_copy",
    "require_peft",
    "wanted",
]
