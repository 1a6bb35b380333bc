"""Loading and running Hugging Face models: causal LMs for policies, scalar-head models for
rewards, and the per-token log-probabilities of completions.

``trust_remote_code`` is off unless the caller turns it on. Weights are read and written as
safetensors; everything is saved as a Hugging Face directory that plain ``transformers``
loads.
"""

from __future__ import annotations

import functools
import inspect
import logging
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from posttrain.core import token_entropy, token_logprobs

log = logging.getLogger(__name__)

BUILTIN = "builtin"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def builtin_model_dir() -> Path:
    """The shipped default model (see ``posttrain.builtin.build``)."""
    return Path(__file__).parent / "builtin" / "model"


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


def has_plain_head(model: PreTrainedModel) -> bool:
    """Whether logits are exactly ``lm_head(last_hidden_state)`` (no soft-capping/scaling),
    so we may apply the head to the positions we need only."""
    cfg = model.config
    return (getattr(cfg, "final_logit_softcapping", None) is None
            and getattr(cfg, "logit_scale", None) in (None, 1.0)
            and model.get_output_embeddings() is not None)


def _scatter_logprobs(logits: torch.Tensor, labels: torch.Tensor, target: torch.Tensor,
                      with_entropy: bool):
    """Log-probs of ``labels`` from packed ``logits`` ``(N, V)``, written back to the
    positions ``target`` marks (0 elsewhere); optionally the entropy too, without gradient."""
    lp = token_logprobs(logits, labels)  # (N,)
    out = torch.zeros(target.shape, dtype=lp.dtype, device=lp.device).masked_scatter(target, lp)
    if not with_entropy:
        return out
    with torch.no_grad():
        ent = token_entropy(logits.detach())
    return out, torch.zeros_like(out).masked_scatter(target, ent)


def completion_logprobs(model: PreTrainedModel, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                        with_entropy: bool = False):
    """Log-probabilities of the tokens marked by ``loss_mask``, ``(B, T-1)``.

    ``input_ids``, ``attention_mask``, ``loss_mask`` are ``(B, T)``; entry ``t`` of the result
    is ``log π(input_ids[t+1] | input_ids[≤t])`` where ``loss_mask[t+1]`` is set, else 0. The
    LM head runs only at those positions: prompt and padding positions never become logits.
    With ``with_entropy`` it also returns the policy's entropy at the same positions
    ``(B, T-1)``, computed without gradient from the same logits (a metric).
    """
    target = loss_mask[:, 1:].bool()  # (B, T-1)
    labels = input_ids[:, 1:][target]  # (N,)
    if has_plain_head(model):
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).last_hidden_state  # (B, T, H)
        logits = model.get_output_embeddings()(hidden[:, :-1][target])  # (N, V)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       use_cache=False).logits[:, :-1][target]
    return _scatter_logprobs(logits, labels, target, with_entropy)


@functools.cache
def _cache_kwarg_for(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(module: torch.nn.Module) -> str:
    """Name of the KV-cache argument of ``module.forward``: transformers ≥ 5.24 renamed
    ``past_key_values`` to ``cache``; older releases know only the former."""
    return _cache_kwarg_for(type(module))


def shared_prompt_logprobs(model: PreTrainedModel, prompt_ids: torch.Tensor,
                           prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                           completion_mask: torch.Tensor,
                           prompt_index: torch.Tensor | None = None,
                           with_entropy: bool = False):
    """Log-probabilities of ``k`` completions per prompt with the prompt run once.

    ``prompt_ids``/``prompt_mask`` are ``(B, Lp)``, *left*-padded; ``completion_ids``/
    ``completion_mask`` are ``(k·B, Lc)``, right-padded, in blocks: rows ``j·B + i`` are
    completions of prompt ``i``. Returns ``(k·B, Lc)``: entry ``t`` is
    ``log π(completion[t] | prompt, completion[<t])``, 0 where the mask is 0.

    The prompt's keys and values are computed once and shared (with gradient) by its ``k``
    completions, so for DPO (k = 2) the prompt tokens cost one forward and backward instead
    of two. Equals :func:`completion_logprobs` on the concatenated sequences.
    ``prompt_index`` ``(k·B,)`` overrides the block layout: row ``r`` continues prompt
    ``prompt_index[r]`` (GRPO groups, any subset of them). ``with_entropy`` also returns the
    entropy at the same positions (no gradient).
    """
    if not has_plain_head(model):
        raise ValueError("shared_prompt_logprobs needs logits = lm_head(hidden states)")
    B = prompt_ids.shape[0]
    k = completion_ids.shape[0] // B
    rows = (torch.arange(B, device=prompt_ids.device).repeat(k) if prompt_index is None
            else prompt_index)  # (kB,) prompt of each row
    positions = (prompt_mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    kw = cache_kwarg(model.base_model)
    h_prompt = model.base_model(input_ids=prompt_ids, attention_mask=prompt_mask,
                                position_ids=positions, use_cache=True,
                                **{kw: cache}).last_hidden_state[:, -1]  # (B, H)
    cache.batch_select_indices(rows)
    Lc = completion_ids.shape[1]
    c_positions = positions[rows, -1:] + 1 + torch.arange(Lc, device=positions.device)
    h_comp = model.base_model(input_ids=completion_ids,
                              attention_mask=torch.cat([prompt_mask[rows], completion_mask], 1),
                              position_ids=c_positions, use_cache=True,
                              **{kw: cache}).last_hidden_state  # (kB, Lc, H)
    # token t of a completion is predicted from the hidden state before it
    h = torch.cat([h_prompt[rows].unsqueeze(1), h_comp[:, :-1]], dim=1)  # (kB, Lc, H)
    target = completion_mask.bool()
    logits = model.get_output_embeddings()(h[target])  # (N, V)
    return _scatter_logprobs(logits, completion_ids[target], target, with_entropy)


def sequence_scores(model: PreTrainedModel, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar score of each sequence, read at its last non-padding token, ``(B,)``.

    The position comes from ``attention_mask`` (not from the pad id, which may equal eos), so
    left and right padding both work.
    """
    head = getattr(model, "score", None)
    T = attention_mask.shape[1]
    positions = torch.arange(T, device=attention_mask.device)
    last = torch.where(attention_mask.bool(), positions, -1).amax(dim=1)  # (B,)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    if isinstance(head, torch.nn.Module):
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).last_hidden_state
        return head(hidden[rows, last]).squeeze(-1).float()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return logits.squeeze(-1).float() if logits.dim() == 2 else logits[rows, last, 0].float()


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
               ) -> None:
    """Save as a Hugging Face directory (safetensors weights, config, tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
