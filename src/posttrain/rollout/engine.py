"""The rollout engine interface, and the decoding loop the two in-process engines share.

An engine is an object the trainer holds for the whole run:

- ``generate(prompts, n, params, generator, uniforms, extras) -> Rollout``: ``n`` samples
  per prompt; ``extras`` asks for optional outputs the engine lists in its own ``extras``;
- ``update_weights(policy)``: after the last optimiser step of each RL step, so the sampler
  samples from the policy being trained (an engine with its own copy of the weights, vLLM
  say, copies them here);
- ``close()``: release what the engine holds.

For P prompts and G samples each, the in-process engines prefill the P (left-padded)
prompts once with the model's forward, repeat the cache G times, and decode token by token:
one forward of the active rows per step, temperature / top-k / top-p on the last logits only,
and rows that finished (eos, a stop string, or the token budget) are dropped from the cache
so later steps run on fewer rows. ``transformers.generate`` does the same sampling with more
per-token machinery (logits processors, stopping criteria objects, a padded batch to the
end); for small models that overhead is most of the time. What differs between engines is
the decoder of one step (:meth:`DecodingEngine.decoder`).

Sampling log-probabilities are those of the distribution actually sampled from (after
temperature, top-k and top-p); with ``temperature=1`` and no truncation they equal the
policy's log-probabilities of the tokens, up to floating-point differences between the
incremental and the full forward.
"""

from __future__ import annotations

import hashlib

import torch
from transformers import DynamicCache

from posttrain.data import pad_left
from posttrain.models import cache_kwarg
from posttrain.rollout.types import Rollout, SamplingParams, cut_at_stop


class RolloutEngine:
    """The interface the trainers hold (see the module docstring)."""

    name = "engine"
    extras: frozenset[str] = frozenset()
    """The optional outputs ``generate(..., extras=...)`` can keep in ``Rollout.cache``:
    ``projections`` (each projection's output, for the update to replay) and
    ``head_stats`` (each sampling distribution's log-sum-exp and entropy)."""

    def generate(self, prompts: list[str], n: int = 1, params: SamplingParams | None = None,
                 generator: torch.Generator | None = None,
                 uniforms: torch.Tensor | None = None,
                 extras: frozenset[str] = frozenset()) -> Rollout:
        raise NotImplementedError

    def update_weights(self, policy) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


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


def _head_stats(stats: torch.Tensor, end: torch.Tensor) -> torch.Tensor | None:
    """``stats`` ``(2, N, Tc)`` zeroed past each sample's ``end``, on the CPU; None if any
    is not finite (a logit of -inf, say)."""
    cols = torch.arange(stats.shape[-1], device=stats.device)
    stats = stats.masked_fill(cols[None, None, :] > end[None, :, None], 0.0).cpu()
    return stats if bool(torch.isfinite(stats).all()) else None


def sampling_uniforms(seed: int, step: int, round_: int, rows: int, columns: int
                      ) -> torch.Tensor:
    """The uniform numbers of one RL step's sampling round, ``(rows, columns)``: row ``i``
    for sample ``i`` of the round (prompt slot ``i // G``), from a generator seeded by
    ``(seed, step, round)`` alone, so the samples drawn depend neither on how the prompts
    are spread over ranks nor on what else a batch holds."""
    digest = hashlib.sha256(f"posttrain-sampling/{seed}/{step}/{round_}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.rand(rows, columns, generator=gen)


def compaction(live: torch.Tensor) -> torch.Tensor:
    """The rows to keep, in their new cache order, when only ``live`` (R,) rows go on: slot
    ``p`` of the first ``n = live.sum()`` keeps its row when that row is live, and a finished
    row's slot takes a live row from beyond ``n``. Only as many cache rows move as rows
    finished (keeping the live rows in order would move every row after the first one
    that finished, each step a row finishes)."""
    n = int(live.sum())
    rows = torch.arange(n, device=live.device)
    holes = (~live[:n]).nonzero().squeeze(-1)
    rows[holes] = live[n:].nonzero().squeeze(-1) + n
    return rows


def _prefill(model, prompt_ids: list[list[int]], n: int, pad_id: int, device):
    """The prompts' forward, left-padded so every prompt ends at the last column: their KV
    cache, and for each of the ``n`` samples per prompt the next-token logits ``(N, V)``,
    attention mask ``(N, Lp)`` and next position ``(N,)``."""
    ids, mask = pad_left(prompt_ids, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=1, **{cache_kwarg(model): cache})
    logits = out.logits[:, -1].repeat_interleave(n, dim=0)  # (N, V)
    return (cache, logits, mask.repeat_interleave(n, dim=0),
            positions[:, -1].repeat_interleave(n) + 1)


def _finished(tok: torch.Tensor, eos_id: int | None, stop: tuple[str, ...], tokenizer,
              tokens: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
    """Which active rows the token ``tok`` (R,) ends: eos, or the row's text so far
    (``tokens[row]``; rows ``active``, all while None) containing a stop string. A tokenizer
    without eos: only a stop string or the budget ends a row."""
    finished = (tok == eos_id if eos_id is not None
                else torch.zeros_like(tok, dtype=torch.bool))
    if stop:  # the rows are read on the host only here
        rows = range(len(tok)) if active is None else active.tolist()
        for j, row in enumerate(rows):
            if not finished[j]:
                text = tokenizer.decode(tokens[row], skip_special_tokens=True)
                finished[j] = any(s in text for s in stop)
    return finished


def _draw(logits, params: SamplingParams, generator, u, t: int, active, tokens, logps, head):
    """Step ``t``'s tokens for the active rows, written with their log-probs into column
    ``t`` of ``tokens`` / ``logps`` ``(N, T)`` (rows ``active``, or all while None), and
    their distributions' statistics into ``head`` ``(2, N, T)`` when kept; returns the
    tokens and ``head`` (None from the first step whose sampling has no statistics)."""
    rows = slice(None) if active is None else active
    if head is None:
        (tok, lp), st = sample_tokens(logits, params, generator, u), None
    else:
        tok, lp, st = sample_tokens(logits, params, generator, u, stats=True)
    tokens[rows, t], logps[rows, t] = tok, lp
    if st is None:
        return tok, None
    head[:, rows, t] = torch.stack(st)
    return tok, head


class DecodingEngine(RolloutEngine):
    """An engine that decodes with the policy module itself, in this process: it holds the
    module, not a copy, so ``update_weights`` only rebinds it."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def update_weights(self, policy) -> None:
        self.model = policy  # the same weights, already updated in place

    def close(self) -> None:
        self.model = None

    def decoder(self, cache, n: int, max_len: int, mask: torch.Tensor, pos: torch.Tensor,
                capture: bool):
        """The object that runs one decode step (``step(tokens) -> logits``, ``select(rows)``,
        ``activations(columns, end)``: the projections' outputs when ``capture``) over the
        prefilled ``cache``."""
        raise NotImplementedError

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int = 1, params: SamplingParams | None = None,
                 generator: torch.Generator | None = None,
                 uniforms: torch.Tensor | None = None,
                 extras: frozenset[str] = frozenset()) -> Rollout:
        """Sample ``n`` completions for each prompt (see the module docstring). ``extras``:
        what to keep in ``Rollout.cache`` of what this engine lists in its ``extras``
        (others are ignored). ``uniforms`` ``(P·n, max_new_tokens)``: the number in [0, 1)
        that picks sample ``i``'s token ``t`` (instead of ``generator``), so each sample's
        draws are its own whatever else is in the batch (the trainers derive them from seed,
        step and prompt slot: :func:`sampling_uniforms`). ``head_stats`` is kept with plain
        sampling only (temperature > 0, no top-k / top-p)."""
        model, tokenizer = self.model, self.tokenizer
        params = params or SamplingParams()
        params.validate()
        device = next(model.parameters()).device
        pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        P, Lp = len(prompt_ids), max(len(x) for x in prompt_ids)
        N, T = P * n, params.max_new_tokens

        if uniforms is not None:
            uniforms = uniforms.to(device)
        was_training = model.training
        model.eval()
        cache, logits, mask, next_pos = _prefill(model, prompt_ids, n, pad_id, device)
        extras = extras & self.extras
        decoder = self.decoder(cache, n, Lp + T, mask, next_pos, "projections" in extras)

        tokens = torch.full((N, T), pad_id, dtype=torch.long, device=device)
        logps = torch.zeros(N, T, device=device)
        # what the update's head can take of each sampling distribution
        head = (torch.zeros(2, N, T, device=device) if "head_stats" in extras
                and params.top_k == 0
                and params.top_p >= 1.0 and params.temperature > 0 else None)
        done = torch.zeros(N, dtype=torch.bool, device=device)
        end = torch.full((N,), T - 1, dtype=torch.long, device=device)  # last step of each row
        active = None  # rows still in the cache, in cache order; None while that is all of them
        stop = params.stop
        steps = 0
        for t in range(T):
            u = None
            if uniforms is not None:
                u = uniforms[:, t] if active is None else uniforms[active, t]
            tok, head = _draw(logits, params, generator, u, t, active, tokens, logps, head)
            steps = t + 1
            finished = _finished(tok, eos_id, stop, tokenizer, tokens[:, :t + 1], active)
            if finished.any():  # the loop's one host sync per step
                rows = finished.nonzero().squeeze(-1) if active is None else active[finished]
                done[rows] = True
                end[rows] = t
                keep = compaction(~finished)
                if len(keep) == 0 or t == T - 1:
                    break
                decoder.select(keep)
                active = keep if active is None else active[keep]
                tok = tok[keep]
            if t == T - 1:
                break
            logits = decoder.step(tok)
        model.train(was_training)
        activations = decoder.activations(steps, end.clamp_max(steps - 1))
        if head is not None:
            head = _head_stats(head[:, :, :steps], end.clamp_max(steps - 1))
        rollout = self._finish(prompt_ids, n, tokens[:, :steps], logps[:, :steps], done, end,
                               params.stop)
        if activations is not None or head is not None:  # the one door to the update
            from posttrain.fast.cache import SamplerCache, policy_version

            rollout.cache = SamplerCache(activations, head, policy_version(model))
        return rollout

    def _finish(self, prompt_ids: list[list[int]], n: int, tokens: torch.Tensor,
                logps: torch.Tensor, done: torch.Tensor, end: torch.Tensor,
                stop: tuple[str, ...]) -> Rollout:
        """The :class:`Rollout` of the sampled ``tokens`` / ``logps`` ``(N, steps)``: a row's
        completion runs up to and including the token that finished it (its first eos or the
        one completing a stop string), else to the end; it is pad from there on."""
        pad_id, steps = self.tokenizer.pad_token_id, tokens.shape[1]
        tokens, logps = tokens.cpu(), logps.cpu()
        done, end = done.cpu(), end.cpu().clamp_max(steps - 1)
        cols = torch.arange(steps)
        completion_mask = (cols[None, :] <= end[:, None]).long()
        if steps == 0:
            completion_mask = completion_mask[:, :0]
        tokens = tokens.masked_fill(completion_mask == 0, pad_id)
        logps = logps.masked_fill(completion_mask == 0, 0.0)
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        if stop:
            texts = [cut_at_stop(x, stop) for x in texts]
        P = len(prompt_ids)
        return Rollout(prompt_ids=[x for x in prompt_ids for _ in range(n)],
                       completion_ids=tokens, completion_mask=completion_mask, logprobs=logps,
                       truncated=~done, group_ids=torch.arange(P).repeat_interleave(n),
                       texts=texts)
