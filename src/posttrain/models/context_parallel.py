"""Context parallelism (``--context_parallel k``): each sequence's tokens split over the k
ranks of a group for the training forward and backward, so that a sequence k times longer
than one process holds fits (docs/scaling.md).

A group's ranks hold the same micro-batch (:func:`posttrain.dist.data_rank`). Each rank runs
the model on one contiguous k-th of the columns (the sequence padded at its end to a
multiple of k: causal attention never reads those columns). Everything but attention is
token-local. Attention is Ulysses-style: before it, an all-to-all turns "my tokens, every
head" into "every token, my k-th of the heads"; each rank computes exact causal attention
for its heads over the whole sequence; a second all-to-all turns it back. Key-value heads
go through the exchange as they are when k divides them (grouped-query attention stays
grouped), else repeated to the query heads first. The query heads must divide by k: a model
whose heads do not is refused (ring attention, which would take it, is not implemented).

Per-token results (log-probs, entropies, hidden states at completions) are gathered so
that every rank of the group holds the whole micro-batch's, and computes the same loss; in
the backward each rank keeps the gradient of its own columns only (:class:`_Gather`), so the
group's parameter gradients sum to one process's, and the run sums gradients over every rank
as it does without context parallelism. Attention runs per stretch of a row that attends to
itself (a packed sequence, a padded row's tokens) with PyTorch's causal SDPA, never through
a ``(T, T)`` mask.

Only the models a run trains and their frozen companions on the same rows (reference,
critic, teacher) are split (:func:`enable`); sampling and the reward model's scoring are not.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from functools import partial
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from posttrain import dist

NAME = "posttrain_context_parallel"
"""The attention implementation a split forward sets on the model's config while it runs."""


class _State(threading.local):
    split: Split | None = None


_STATE = _State()


def unsupported(config) -> str | None:
    """Why a model with this config cannot be split over :func:`posttrain.dist.context_size`
    ranks, or None."""
    k = dist.context_size()
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    if not heads or heads % k:
        return (f"context_parallel {k}: the model's {heads} attention heads do not split over "
                f"{k} ranks (posttrain splits heads, Ulysses-style; ring attention, which "
                "would take any head count, is not implemented): pick a k that divides them")
    kinds = set(getattr(config, "layer_types", None) or ())
    # (Mistral, Phi-3, Starcoder2 set sliding_window alone; Qwen2 sets it with
    # use_sliding_window false, which means full attention)
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window",
                                                                 True)
    if kinds - {"full_attention"} or getattr(config, "attn_logit_softcapping", None) or window:
        return (f"context_parallel: {type(config).__name__} has sliding-window or soft-capped "
                "attention; context parallelism computes full causal attention only")
    return None


def enable(model):
    """Mark ``model`` to run its training forwards split over the context-parallel group
    (nothing with a group of one); returns it. Raises :class:`ConfigError` for a model
    whose attention cannot be split."""
    if dist.context_size() == 1 or model is None:
        return model
    why = unsupported(model.config)
    if why:
        from posttrain.config import ConfigError

        raise ConfigError(why)
    _register()
    model.posttrain_context_parallel = True
    return model


def active(model) -> bool:
    """Whether ``model``'s forwards are split (:func:`enable`)."""
    return dist.context_size() > 1 and getattr(model, "posttrain_context_parallel", False)


_REGISTERED = []


def _register() -> None:
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, _attention)
        _REGISTERED.append(NAME)


class Split:
    """A ``(B, T)`` micro-batch split over the group: ``T`` padded to ``k · n`` columns, this
    rank's ``[lo, hi)``; the stretches attention runs over; this rank's ids and positions."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None):
        k, r = dist.context_size(), dist.context_rank()
        B, T = input_ids.shape
        n = -(-T // k)
        self.T, self.n, self.padded, self.lo, self.hi = T, n, n * k, r * n, (r + 1) * n
        device = input_ids.device
        pos = (position_ids if position_ids is not None
               else torch.arange(T, device=device).expand(B, T))
        extra = self.padded - T  # after every real column: causal attention never reads them
        ids = F.pad(input_ids, (0, extra))
        # (at the last position again: within any model's range of positions)
        pos = torch.cat([pos, pos[:, -1:].expand(B, extra)], 1)
        valid = (attention_mask.bool() if attention_mask is not None
                 else torch.ones(B, T, dtype=torch.bool, device=device))
        valid = F.pad(valid, (0, extra), value=True)
        # a stretch ends where validity changes or, for packed rows (no mask, positions
        # given), where the positions restart: the model's own mask, as transformers builds it
        cut = valid[:, 1:] != valid[:, :-1]
        if attention_mask is None and position_ids is not None:
            cut |= pos[:, 1:] != pos[:, :-1] + 1
        self.runs: list[list[tuple[int, int]]] = []
        self.whole = not bool(cut.any()) and bool(valid.all())  # (no per-row walk then)
        for b in range(0 if self.whole else B):
            edges = [0, *(torch.nonzero(cut[b]).flatten() + 1).tolist(), self.padded]
            self.runs.append([(s, e) for s, e in pairwise(edges)
                              if bool(valid[b, s])])
        self.ids, self.pos = ids[:, self.lo:self.hi], pos[:, self.lo:self.hi]

    def local(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """This rank's columns of a ``(B, T, ...)`` tensor (padded like the ids)."""
        pad = [0, 0] * (x.dim() - 2) + [0, self.padded - x.shape[1]]
        return F.pad(x, pad, value=fill)[:, self.lo:self.hi]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ``(B, T, ...)`` tensor whose columns are every rank's local ``(B, n, ...)``
        part; the backward keeps this rank's columns' gradient (every rank computes the same
        loss from it)."""
        return _Gather.apply(x, dist.context_group())[:, :self.T]

    def gather_rows(self, values: torch.Tensor, local: torch.Tensor, target: torch.Tensor
                    ) -> torch.Tensor:
        """Per-position ``values`` ``(N_local, ...)`` at this rank's positions ``local``
        ``(B, n)`` → ``(N, ...)`` at every rank's, in row-major order of ``target``
        ``(B, T-1)`` (column t: the position that predicts token t+1)."""
        grid = values.new_zeros((*local.shape, *values.shape[1:]))
        grid = grid.index_put(tuple(local.nonzero().t()), values)
        return self.gather(grid)[:, :-1][target]


@contextmanager
def running(model, split: Split):
    """While a split forward of ``model`` runs: its attention is this module's, over
    ``split``'s stretches. The split is thread-local, the attention setting is the model's
    config: a split model is not run by two threads at once (samplers run on copies)."""
    from posttrain.models.loading import backbone

    _register()
    config = backbone(model).config
    before = config._attn_implementation
    _STATE.split = split
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
        _STATE.split = None


def backbone_hidden(model, input_ids, attention_mask, position_ids=None):
    """This rank's part of the last hidden states, ``(B, n, H)``, and the :class:`Split`."""
    from posttrain.models.loading import backbone

    split = Split(input_ids, attention_mask, position_ids)
    with running(model, split):
        hidden = backbone(model)(input_ids=split.ids, position_ids=split.pos,
                                 use_cache=False).last_hidden_state
    return hidden, split


def model_logits(model, input_ids, attention_mask, position_ids=None):
    """This rank's part of the model's own logits, ``(B, n, V)``, and the :class:`Split`
    (a head :func:`posttrain.models.logprobs.has_plain_head` cannot run on rows)."""
    split = Split(input_ids, attention_mask, position_ids)
    with running(model, split):
        logits = model(input_ids=split.ids, position_ids=split.pos, use_cache=False).logits
    return logits, split


def shared_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the group, each rank having filled its own entries (zeros
    elsewhere); the backward passes the gradient through (every rank computes the same loss)."""
    return _SumShared.apply(x, dist.context_group())


# --- the exchanges -------------------------------------------------------------------------

def _attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
               **kwargs):
    """The attention of a split forward: ``query`` ``(B, H, n, D)``, ``key``/``value``
    ``(B, Hkv, n, D)`` of this rank's columns; returns ``(B, n, H, D)`` (transformers'
    layout) and no weights.

    With gradients, the exchanges and the attention are recomputed in the backward
    (:func:`torch.utils.checkpoint`) rather than kept: kept, the attention's inputs and
    output in the heads' layout would sit beside the same tensors in the tokens' layout
    (one process keeps one copy), about 5% more activation memory per rank than a process
    holding a sequence 1/k as long. The price is one more attention forward and its two
    exchanges in the backward."""
    split = _STATE.split
    if split is None:
        raise RuntimeError("context-parallel attention outside a split forward")
    other = {k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None}
    if other:  # (enable refuses such models; a family it does not know raises here)
        raise ValueError(f"context-parallel attention computes plain causal attention; this "
                         f"layer asks for {', '.join(sorted(other))}")
    p = dropout if module.training else 0.0
    core = partial(_exchange_and_attend, split=split, dropout=p, scaling=scaling)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad):
        return checkpoint(core, query, key, value, use_reentrant=False), None
    return core(query, key, value), None


def _exchange_and_attend(query, key, value, split: Split, dropout: float, scaling):
    group, k = dist.context_group(), dist.context_size()
    heads = query.shape[1]
    if key.shape[1] % k:  # grouped key-value heads that do not split: one per query head
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    q, kk, vv = (_to_heads(x, group, k) for x in (query, key, value))
    gqa = q.shape[1] != kk.shape[1]
    if split.whole:
        out = F.scaled_dot_product_attention(q, kk, vv, dropout_p=dropout, is_causal=True,
                                             scale=scaling, enable_gqa=gqa)
    else:
        rows = []
        for b, runs in enumerate(split.runs):
            parts, at = [], 0
            for s, e in runs:
                if s > at:  # a stretch no valid query reads (padding): zeros
                    parts.append(q.new_zeros(1, q.shape[1], s - at, q.shape[3]))
                parts.append(F.scaled_dot_product_attention(
                    q[b:b + 1, :, s:e], kk[b:b + 1, :, s:e], vv[b:b + 1, :, s:e],
                    dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa))
                at = e
            if at < split.padded:
                parts.append(q.new_zeros(1, q.shape[1], split.padded - at, q.shape[3]))
            rows.append(torch.cat(parts, 2))
        out = torch.cat(rows, 0)
    return _to_tokens(out, group, k)


def _to_heads(x: torch.Tensor, group, k: int) -> torch.Tensor:
    """``(B, H, n, D)`` of this rank's columns → ``(B, H/k, k·n, D)``: every column, this
    rank's k-th of the heads. Exchanged in the tokens-major layout transformers' projections
    produce (``(B, n, H, D)`` in memory), so a batch of one row lands in place: the result is
    a view of the received buffer."""
    B, H, n, D = x.shape
    h = H // k
    parts = x.transpose(1, 2).unflatten(2, (k, h)).permute(2, 0, 1, 3, 4)  # (k, B, n, h, D)
    got = _AllToAll.apply(parts, group)  # (k, B, n, h, D): rank i's columns of my heads
    full = got.view(k * n, h, D)[None] if B == 1 else got.transpose(0, 1).reshape(B, k * n, h, D)
    return full.transpose(1, 2)


def _to_tokens(x: torch.Tensor, group, k: int) -> torch.Tensor:
    """The way back from :func:`_to_heads`' layout: ``(B, H/k, k·n, D)`` → this rank's
    columns, every head, ``(B, n, H, D)``."""
    B, h, T, D = x.shape
    n = T // k
    parts = x.transpose(1, 2).unflatten(1, (k, n)).transpose(0, 1)  # (k, B, n, h, D)
    got = _AllToAll.apply(parts, group)  # (k, B, n, h, D): rank i's heads of my columns
    return got.permute(1, 2, 0, 3, 4).reshape(B, n, k * h, D)


class _AllToAll(torch.autograd.Function):
    """Part ``i`` of the leading dimension to rank ``i`` of the group, part ``i`` of the
    result from rank ``i``; its own transpose, so the backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as td

    x = x.contiguous()
    out = torch.empty_like(x)
    td.all_to_all_single(out, x, group=group)
    return out


class _Gather(torch.autograd.Function):
    """Every rank's ``(B, n, ...)`` joined along dimension 1 in rank order; the backward
    returns this rank's columns of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as td

        k = td.get_world_size(group)
        ctx.rank, ctx.n = td.get_rank(group), x.shape[1]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(k)]
        td.all_gather(parts, x, group=group)
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


class _SumShared(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as td

        out = x.clone()
        td.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None
