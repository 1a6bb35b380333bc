"""Per-token log-probabilities, hidden states, values and scores of Hugging Face models,
computed at the positions that need them only.

The LM head runs only at completion positions: prompt and padding positions never become
logits, so a pass holds ``(N, V)`` logits for its ``N`` completion tokens, never
``(B, T, V)``. A head that transforms its logits (Gemma-2/3's final soft-capping, Cohere's
logit scale, Granite's logit scaling) has the transform applied to those rows
(:func:`head_logits`), the same arithmetic as the model's own forward.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from posttrain.core import token_entropy, token_logprobs
from posttrain.core.logprobs import head_logit_transform, head_token_logprobs
from posttrain.models import context_parallel
from posttrain.models.loading import backbone, for_device


def has_plain_head(model: PreTrainedModel) -> bool:
    """Whether the model's logits are its output embeddings applied to the last hidden
    state, followed at most by a transform :func:`head_logits` knows; then the head may run
    on the positions that need it only."""
    return model.get_output_embeddings() is not None


def logit_transform(config) -> dict[str, float]:
    """The model family's transform of its head's output, as its forward applies it (the
    keywords of :func:`posttrain.core.logprobs.head_logit_transform`): Cohere multiplies
    by ``logit_scale``, Granite divides by ``logits_scaling``, Gemma-2/3 soft-cap."""
    return {"scale": getattr(config, "logit_scale", None) or 1.0,
            "divide": getattr(config, "logits_scaling", None) or 1.0,
            "softcap": getattr(config, "final_logit_softcapping", None) or 0.0}


def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Logits ``(N, V)`` from last hidden states ``(N, H)``: the output embeddings, then the
    model family's logit transform."""
    return head_logit_transform(model.get_output_embeddings()(hidden),
                                **logit_transform(model.config))


FUSED_HEAD_MIN_ELEMENTS = {"cpu": 1 << 26, "cuda": 1 << 26}
"""Logits (rows × vocabulary) from which the head is fused into the log-probs, per device
type: below it (256 MiB of float32) the full logits are cheap to hold, and the fused
backward's second head matmul (it recomputes each chunk's logits: 4 head matmuls instead of
3 with the weight's gradient) would cost time for nothing. The CPU figure is measured on 2
cores; CUDA's is not measured yet and keeps it (there memory, not the extra matmul, is
what the fused head is for)."""


def fusable_head(model: PreTrainedModel, rows: int):
    """The output embeddings as a plain ``nn.Linear`` whose weight the fused log-prob path
    can read, when ``rows`` of its logits would reach :data:`FUSED_HEAD_MIN_ELEMENTS`; else
    None (small logits, a sharded or quantised weight, another module type)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return None
    w = head.weight
    if hasattr(w, "to_local") or not w.dtype.is_floating_point:
        return None
    return head if rows * w.shape[0] >= for_device(FUSED_HEAD_MIN_ELEMENTS, w.device) else None


def head_logprobs(model: PreTrainedModel, hidden: torch.Tensor, labels: torch.Tensor,
                  target: torch.Tensor, with_entropy: bool, temperature: float = 1.0,
                  known: torch.Tensor | None = None):
    """Log-probs of ``labels`` ``(N,)`` from last hidden states ``(N, H)``, scattered to the
    positions ``target`` marks (and the entropy, without gradient). With a plain linear
    head and large logits, the head runs inside the log-prob computation a chunk of rows at
    a time, forward and backward (:func:`posttrain.core.logprobs.head_token_logprobs`): no
    ``(N, V)`` logits are ever held. Otherwise the head's logits are formed and reduced.
    ``known`` ``(2, N)``: each row's log-sum-exp and entropy of these very logits, computed
    elsewhere (the sampler's, for the policy as it is now); the fused head then skips its
    forward matmul (float32 heads only: there the given figures are the head's own to
    rounding)."""
    head = fusable_head(model, hidden.shape[0])
    if head is None:
        return scatter_logprobs(tempered(head_logits(model, hidden), temperature), labels,
                                target, with_entropy)
    if head.weight.dtype != torch.float32 or hidden.dtype != torch.float32:
        known = None
    res = head_token_logprobs(hidden, head.weight, labels, head.bias,
                              temperature=temperature, with_entropy=with_entropy,
                              known=known, **logit_transform(model.config))
    return _placed(*(res if with_entropy else (res,)), target=target)


def scatter_logprobs(logits: torch.Tensor, labels: torch.Tensor, target: torch.Tensor,
                     with_entropy: bool):
    """Log-probs of ``labels`` from packed ``logits`` ``(N, V)``, written back to the
    positions ``target`` marks (0 elsewhere); optionally the entropy too, without gradient."""
    lp = token_logprobs(logits, labels)  # (N,)
    if not with_entropy:
        return _placed(lp, target=target)
    with torch.no_grad():
        ent = token_entropy(logits.detach())
    return _placed(lp, ent, target=target)


def _placed(*values: torch.Tensor, target: torch.Tensor):
    """Each packed ``(N,)`` tensor written to the positions ``target`` marks (0 elsewhere):
    one tensor, or a tuple of them."""
    out = tuple(torch.zeros(target.shape, dtype=v.dtype, device=v.device)
                .masked_scatter(target, v) for v in values)
    return out[0] if len(out) == 1 else out


def completion_logprobs(model: PreTrainedModel, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor | None, loss_mask: torch.Tensor,
                        with_entropy: bool = False, temperature: float = 1.0,
                        position_ids: torch.Tensor | None = None):
    """Log-probabilities of the tokens marked by ``loss_mask``, ``(B, T-1)``.

    ``input_ids``, ``attention_mask``, ``loss_mask`` are ``(B, T)``; entry ``t`` of the result
    is ``log π(input_ids[t+1] | input_ids[≤t])`` where ``loss_mask[t+1]`` is set, else 0. The
    LM head runs only at those positions: prompt and padding positions never become logits.
    With ``with_entropy`` it also returns the policy's entropy at the same positions
    ``(B, T-1)``, computed without gradient from the same logits (a metric). ``temperature``
    divides the logits first: the distribution a sampler at that temperature draws from.
    ``position_ids`` (with ``attention_mask`` None): packed rows, each sequence's positions
    from 0 (:func:`posttrain.data.pack_sequences`); the model keeps each to itself.
    """
    if context_parallel.active(model):
        return _split_logprobs(model, input_ids, attention_mask, loss_mask, with_entropy,
                               temperature, position_ids)
    target = loss_mask[:, 1:].bool()  # (B, T-1)
    labels = input_ids[:, 1:][target]  # (N,)
    if has_plain_head(model):
        hidden = completion_hidden(model, input_ids, attention_mask, loss_mask, position_ids)
        return head_logprobs(model, hidden, labels, target, with_entropy, temperature)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids, use_cache=False).logits[:, :-1][target]
    return scatter_logprobs(tempered(logits, temperature), labels, target, with_entropy)


def _split_logprobs(model, input_ids, attention_mask, loss_mask, with_entropy, temperature,
                    position_ids):
    """:func:`completion_logprobs` of a context-parallel model: this rank's columns through
    the model and the head, then every rank's log-probs (and entropies) gathered."""
    if has_plain_head(model):
        hidden, split = context_parallel.backbone_hidden(model, input_ids, attention_mask,
                                                         position_ids)
    else:
        logits, split = context_parallel.model_logits(model, input_ids, attention_mask,
                                                      position_ids)
    # column t predicts token t+1: the targets and labels shifted, padded like the ids
    target = split.local(loss_mask[:, 1:].bool(), False)  # (B, n)
    labels = split.local(input_ids[:, 1:])[target]
    if has_plain_head(model):
        out = head_logprobs(model, hidden[target], labels, target, with_entropy, temperature)
    else:
        out = scatter_logprobs(tempered(logits[target], temperature), labels, target,
                               with_entropy)
    out = tuple(split.gather(x)[:, :-1] for x in (out if with_entropy else (out,)))
    return out if with_entropy else out[0]


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` (the logits themselves at 1)."""
    return logits if temperature == 1.0 else logits / temperature

def completion_hidden(model: PreTrainedModel, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None, loss_mask: torch.Tensor,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden states at the positions that predict the tokens ``loss_mask`` marks,
    ``(N, H)`` in row-major order of ``loss_mask[:, 1:]``: what an LM head turns into
    log-probs and a critic's value head into values ``V(x, y_<t)`` (``position_ids``: as
    for :func:`completion_logprobs`). Context-parallel: every rank's rows, gathered (the
    backward keeps this rank's columns' gradient); a head with parameters goes through
    :func:`completion_apply` instead.)"""
    if context_parallel.active(model):  # every rank's columns (the backward keeps its own)
        hidden, split = context_parallel.backbone_hidden(model, input_ids, attention_mask,
                                                         position_ids)
        return split.gather(hidden)[:, :-1][loss_mask[:, 1:].bool()]
    hidden = backbone(model)(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids,
                              use_cache=False).last_hidden_state  # (B, T, H)
    return hidden[:, :-1][loss_mask[:, 1:].bool()]

def completion_apply(model: PreTrainedModel, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None, loss_mask: torch.Tensor, fn,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``fn`` (a head: ``(N, H)`` hidden states → ``(N, ...)``) applied to
    :func:`completion_hidden`'s rows. Context-parallel, each rank applies ``fn`` to its own
    columns' rows and the results are gathered, so the head's parameters get each token's
    gradient once (applied to gathered hidden states, every rank would add all of it)."""
    if context_parallel.active(model):
        hidden, split = context_parallel.backbone_hidden(model, input_ids, attention_mask,
                                                         position_ids)
        local = split.local(loss_mask[:, 1:].bool(), False)
        return split.gather_rows(fn(hidden[local]), local, loss_mask[:, 1:].bool())
    return fn(completion_hidden(model, input_ids, attention_mask, loss_mask, position_ids))


def value_head(model: PreTrainedModel) -> torch.nn.Module:
    """The scalar head of a reward or critic model (``*ForSequenceClassification.score``)."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise ValueError(f"{type(model).__name__} has no scalar `score` head to use as a critic")
    return head

def sequence_scores(model: PreTrainedModel, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None = None,
                    ends: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar score of each sequence, read at its last non-padding token, ``(B,)``.

    The position comes from ``attention_mask`` (not from the pad id, which may equal eos), so
    left and right padding both work. Packed rows (:func:`posttrain.data.pack_sequences`):
    ``position_ids`` and ``ends`` ``(N, 2)``, each sequence's row and last column, with
    ``attention_mask`` None; the scores of the N sequences.
    """
    head = getattr(model, "score", None)
    if ends is not None:
        rows, last = ends[:, 0], ends[:, 1]
    else:
        T = attention_mask.shape[1]
        positions = torch.arange(T, device=attention_mask.device)
        last = torch.where(attention_mask.bool(), positions, -1).amax(dim=1)  # (B,)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    if isinstance(head, torch.nn.Module) and context_parallel.active(model):
        hidden, split = context_parallel.backbone_hidden(model, input_ids, attention_mask,
                                                         position_ids)
        mine = (last >= split.lo) & (last < split.hi)  # the sequences that end in my columns
        local = head(hidden[rows[mine], last[mine] - split.lo]).squeeze(-1).float()
        scores = torch.zeros(len(rows), dtype=local.dtype, device=local.device)
        return context_parallel.shared_sum(scores.masked_scatter(mine, local))
    if context_parallel.active(model):
        raise ValueError(f"context parallelism needs a `score` head; {type(model).__name__} "
                         "has none")
    if isinstance(head, torch.nn.Module):
        hidden = backbone(model)(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, use_cache=False).last_hidden_state
        return head(hidden[rows, last]).squeeze(-1).float()
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids, use_cache=False).logits
    return logits.squeeze(-1).float() if logits.dim() == 2 else logits[rows, last, 0].float()
