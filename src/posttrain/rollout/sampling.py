"""Drawing one token per row from the last logits: temperature, top-k and top-p, and a
two-level inverse CDF that writes one vocabulary-sized tensor per step. The log-probs
returned are those of the distribution actually sampled (the behaviour log-probs)."""

from __future__ import annotations

import torch

from posttrain.rollout.types import SamplingParams

CDF_BLOCK = 2048
"""Vocabulary entries per block of the two-level inverse CDF (:func:`_inverse_cdf`)."""


def sample_tokens(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None,
                  u: torch.Tensor | None = None, stats: bool = False):
    """Sample one token per row from ``logits`` (R, V); return (tokens, log-probs). ``u``
    (R,): each row's uniform number in [0, 1); drawn from ``gen`` when None. ``stats``: also
    the log-sum-exp and entropy (R,) of the tempered distribution, for plain sampling (no
    top-k / top-p; else None): (tokens, log-probs, stats)."""
    logits = logits.float()
    if p.temperature == 0:
        tokens = logits.argmax(-1)
        out = tokens, torch.zeros_like(tokens, dtype=torch.float32)
        return (*out, None) if stats else out
    if u is None:  # drawn on the generator's device (a CPU generator drives a CUDA policy too)
        u = torch.rand(len(logits), generator=gen,
                       device=gen.device if gen is not None else logits.device)
    u = u.to(logits.device, torch.float32)
    if not (p.top_k and p.top_k < logits.shape[-1]) and p.top_p >= 1.0:
        return _inverse_cdf(logits, p.temperature, u, stats)
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    out = _inverse_cdf(logits, 1.0, u)
    return (*out, None) if stats else out


def _inverse_cdf(logits: torch.Tensor, temperature: float, u: torch.Tensor,
                 stats: bool = False):
    """Inverse-CDF sampling from ``softmax(logits / temperature)`` (R, V) with one uniform
    number per row (torch.multinomial, or a Gumbel / exponential race, draw one per
    vocabulary entry, which dominates a small model's step); the tokens and their log-probs.

    The token is the first ``v`` whose cumulative mass reaches ``u`` times the total, found
    in two levels: the per-block sums of ``exp(z − max)`` pick the block, a cumulative sum
    inside that one block picks the token. So one (R, V) tensor is written, not the four of
    log-softmax, its exponential and a full cumulative sum, which at a large vocabulary are
    most of a decode step's sampling time."""
    R, V = logits.shape
    top = logits.amax(-1, keepdim=True)  # (R, 1); -inf only for a row with no finite logit
    e = torch.sub(logits, top)
    if temperature != 1.0:
        e.div_(temperature)
    e.exp_()  # (R, V) unnormalised probabilities, in (0, 1]
    if V <= CDF_BLOCK:  # one block: its running sum is the whole CDF
        cdf = e.cumsum(-1)
        total = cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u[:, None] * total).clamp_max_(V - 1).squeeze(-1)
        return _picked(logits, e, top, total, tokens, temperature, stats)
    n_full = V // CDF_BLOCK
    sums = [e[:, :n_full * CDF_BLOCK].view(R, n_full, CDF_BLOCK).sum(-1)] if n_full else []
    if V % CDF_BLOCK:
        sums.append(e[:, n_full * CDF_BLOCK:].sum(-1, keepdim=True))
    cum = torch.cat(sums, -1).cumsum(-1)  # (R, blocks)
    total = cum[:, -1:]
    target = u[:, None] * total  # (R, 1)
    block = torch.searchsorted(cum, target).clamp_max(cum.shape[1] - 1)  # (R, 1)
    before = torch.where(block > 0, cum.gather(-1, (block - 1).clamp_min(0)), 0.0)
    cols = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=e.device)  # (R, CDF_BLOCK)
    inside = cols < V
    mass = e.gather(-1, cols.clamp_max(V - 1)).masked_fill_(~inside, 0.0)  # (R, CDF_BLOCK)
    # rounding may leave the block's own running sum a hair short of ``target``: take its
    # last token with any mass then (never one of probability 0, a top-k / top-p cut one)
    last = torch.where(mass > 0, torch.arange(CDF_BLOCK, device=e.device), 0).amax(
        -1, keepdim=True)
    within = mass.cumsum_(-1)
    j = torch.searchsorted(within.add_(before), target).clamp_max_(last)
    tokens = (block * CDF_BLOCK + j).squeeze(-1)
    return _picked(logits, e, top, total, tokens, temperature, stats)


def _picked(logits, e, top, total, tokens, temperature: float, stats: bool):
    """The sampled tokens' log-probs (and with ``stats`` each row's log-sum-exp and entropy)
    from the logits, their row maximum ``top``, ``e = exp((logits − top) / T)`` and its row
    sums ``total``."""
    R = logits.shape[0]
    logp = ((logits.gather(-1, tokens[:, None]) - top) / temperature
            - total.log()).squeeze(-1)
    if not stats:
        return tokens, logp
    # log Σ exp(z/T) and H = log Σe − Σ e·(z − max)/T / Σe, the dot product as a batched
    # matmul (no (R, V) temporary)
    ez = torch.bmm(e[:, None, :], logits[:, :, None]).view(R, 1)
    lse = top / temperature + total.log()
    ent = total.log() - (ez - top * total) / (temperature * total)
    return tokens, logp, (lse.squeeze(-1), ent.squeeze(-1))
