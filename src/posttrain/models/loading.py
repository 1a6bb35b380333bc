"""Loading and saving Hugging Face models: causal LMs for policies, scalar-head models for
rewards and critics, and the backbone of a (possibly wrapped) model.

``trust_remote_code`` is off unless the caller turns it on. Weights are read and written as
safetensors; everything is saved as a Hugging Face directory that plain ``transformers``
loads. Nothing here is tuned for a machine: the speed machinery is ``posttrain.fast``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

BUILTIN = "builtin"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

def builtin_model_dir() -> Path:
    """The shipped default model (see ``posttrain.builtin.build``)."""
    return Path(__file__).parent.parent / "builtin" / "model"

def resolve(name: str) -> str:
    """``"builtin"`` → the shipped model's directory; anything else is a path or a hub id."""
    if name == BUILTIN:
        path = builtin_model_dir()
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"the built-in model is missing from {path}; rebuild it with "
                "`python -m posttrain.builtin.build`")
        return str(path)
    return name

def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)

def load_tokenizer(name: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(resolve(name), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer of {name} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok

def load_causal_lm(name: str, dtype: str = "float32", device: str = "auto",
                   trust_remote_code: bool = False) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        resolve(name), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    return model.to(pick_device(device))

def load_reward_model(name: str, tokenizer: PreTrainedTokenizerBase, dtype: str = "float32",
                      device: str = "auto", trust_remote_code: bool = False) -> PreTrainedModel:
    """A sequence-classification model with one output: a ``*ForSequenceClassification``
    checkpoint as it is, or a causal-LM checkpoint whose backbone gets a fresh scalar head."""
    model = AutoModelForSequenceClassification.from_pretrained(
        resolve(name), num_labels=1, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(pick_device(device))

def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
               ) -> None:
    """Save as a Hugging Face directory (safetensors weights, config, tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of ``model`` (what returns ``last_hidden_state``), through any
    wrapper: a peft ``PeftModel`` (whose ``base_model`` is its ``LoraModel``, not the
    backbone) is unwrapped to the model it adapts first."""
    inner = model
    get_base = getattr(inner, "get_base_model", None)  # peft wrappers
    if callable(get_base):
        inner = get_base()
    base = getattr(inner, "base_model", None)
    if base is None or base is inner:
        raise ValueError(f"{type(model).__name__} has no decoder backbone (base_model)")
    return base


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of ``model``'s backbone."""
    layers = getattr(backbone(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: its backbone has no `layers`")
    return layers


def moe_experts(config) -> tuple[int, int] | None:
    """``(experts, experts per token)`` of a mixture-of-experts config (Mixtral, Qwen-MoE,
    DeepSeek names), else None."""
    n = next((getattr(config, k) for k in ("num_local_experts", "num_experts",
                                           "n_routed_experts") if getattr(config, k, None)),
             None)
    top_k = next((getattr(config, k) for k in ("num_experts_per_tok", "moe_top_k")
                  if getattr(config, k, None)), None)
    return (int(n), int(top_k)) if n and top_k else None


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters a token's forward pass uses: all of them for a dense model; for a
    mixture-of-experts model the routed experts count ``top_k / experts`` of their size
    (that sets its FLOPs per token, and so every cost decision made from a parameter
    count). Shared experts and the router count in full."""
    total = sum(p.numel() for p in model.parameters())
    moe = moe_experts(getattr(model, "config", None))
    if moe is None:
        return total
    n, top_k = moe
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total - routed + routed * top_k // n
