"""The rollout engine contract, and the decoding loop the two in-process engines share.

An engine is an object the trainer holds for the whole run, with a lifecycle:

- built (started) by :func:`posttrain.rollout.make_engine`;
- ``generate(requests, n, params, generator, extras) -> Rollout``: ``n`` samples of each
  :class:`~posttrain.rollout.types.Request` (token ids and a seed; sample ``j`` draws from
  ``sample_seed(seed, j)`` alone); the result holds the completion ids, the behaviour
  log-probs (of the distribution actually sampled), the finish reasons and the policy
  version. ``extras`` asks for optional outputs the engine lists in its own ``extras``;
- ``sync(weights, version)``: after each optimiser step that changed the policy, the
  weights as a stream of (Hugging Face name, tensor), never a module. An engine that
  decodes with the trainer's own module (``shares_weights``) reads nothing of the stream;
- ``score(sequences, prompt_lens)``: the engine's own log-probs (temperature 1) of given
  token sequences, for the weight-sync guard (:mod:`posttrain.rollout.guard`);
- ``sleep()`` / ``wake()``: release and retake the engine's memory between rollouts where
  the engine supports it (no-ops otherwise);
- ``close()``: release what the engine holds; also a context manager, so it closes on
  errors.

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

import contextlib
from collections.abc import Iterable

import torch
from transformers import DynamicCache

from posttrain.data import pad_left
from posttrain.models import cache_kwarg
from posttrain.rollout.prefixes import Prefixes
from posttrain.rollout.sampling import CDF_BLOCK, sample_tokens
from posttrain.rollout.types import (
    Request,
    Rollout,
    SamplingParams,
    cut_at_stop,
    request_seed,
    request_uniforms,
)
from posttrain.sharding import compute_device

__all__ = ["CDF_BLOCK", "DecodingEngine", "RolloutEngine", "compaction", "request_seed",
           "request_uniforms", "sample_tokens"]


class RolloutEngine:
    """The contract the trainers hold (see the module docstring)."""

    name = "engine"
    extras: frozenset[str] = frozenset()
    """The optional outputs ``generate(..., extras=...)`` can keep in ``Rollout.cache``:
    ``projections`` (each projection's output, for the update to replay) and
    ``head_stats`` (each sampling distribution's log-sum-exp and entropy)."""
    shares_weights = False
    """It decodes with the trainer's own module: a sync has nothing to copy and the guard
    nothing to check."""
    partial_sync = False
    """A sync may carry only the tensors training changes (``hf_weights(changed_only=True)``):
    the engine keeps the rest it was built with."""
    version = 0
    """The policy version of the weights it samples with (set by :meth:`sync`)."""
    needs_sync = False
    """Its :meth:`sleep` dropped weights that only a sync brings back: the trainer syncs it
    before the next rollout even after a step that left the policy as it was."""

    def generate(self, requests: list[Request], n: int = 1,
                 params: SamplingParams | None = None,
                 generator: torch.Generator | None = None,
                 extras: frozenset[str] = frozenset()) -> Rollout:
        raise NotImplementedError

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise NotImplementedError

    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
        """The engine's log-probs (temperature 1) of ``sequences[i][prompt_lens[i]:]``."""
        raise NotImplementedError

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    @contextlib.contextmanager
    def reusing_prefixes(self, managed: bool = False):
        """Within it, a request that extends a sequence an earlier ``generate`` call
        produced (its prompt and completion, e.g. an episode's next turn) may reuse what
        the engine computed for that sequence instead of encoding it again; ``managed``:
        only :meth:`retain_prefixes` releases what is kept. A no-op here (vLLM's prefix
        cache does this on its own)."""
        yield self

    def retain_prefixes(self, sequences) -> None:
        """Inside :meth:`reusing_prefixes`: what is kept for a later request, less what no
        request extending one of ``sequences`` could use (a no-op here)."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _head_stats(stats: torch.Tensor, end: torch.Tensor) -> torch.Tensor | None:
    """``stats`` ``(2, N, Tc)`` zeroed past each sample's ``end``, on the CPU; None if any
    is not finite (a logit of -inf, say)."""
    cols = torch.arange(stats.shape[-1], device=stats.device)
    stats = stats.masked_fill(cols[None, None, :] > end[None, :, None], 0.0).cpu()
    return stats if bool(torch.isfinite(stats).all()) else None


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


def _past_lengths(past: list | None, P: int) -> list[int]:
    """Per prompt, the tokens of it whose keys and values ``past`` holds (0 without)."""
    return [0] * P if past is None else [0 if kv is None else kv[0].shape[2] for kv in past]


def _prefill(model, prompt_ids: list[list[int]], n: int, pad_id: int, device,
             past: list | None = None):
    """The prompts' forward, left-padded so every prompt ends at the last column: their KV
    cache, and for each of the ``n`` samples per prompt the next-token logits ``(N, V)``,
    attention mask ``(N, Lp)`` and next position ``(N,)``. ``past``: per prompt, None or
    the keys and values ``(layers, kv heads, L, head dim)`` of its first L tokens (kept
    from the previous call, :meth:`DecodingEngine.reusing_prefixes`): only the rest is
    run, over a cache of those (left-padded; the mask has a hole between the two parts)."""
    lengths = _past_lengths(past, len(prompt_ids))
    ids, mask = pad_left([p[k:] for p, k in zip(prompt_ids, lengths, strict=True)], pad_id)
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    L = max(lengths)
    if L:
        positions = positions + torch.tensor(lengths, device=device)[:, None]
        ref = next(kv for kv in past if kv is not None)[0]
        layers, heads, _, dim = ref.shape
        k = ref.new_zeros(layers, len(past), heads, L, dim)
        v = torch.zeros_like(k)
        held = torch.zeros(len(past), L, dtype=mask.dtype, device=device)
        for i, kv in enumerate(past):
            if kv is not None:
                k[:, i, :, L - lengths[i]:] = kv[0].to(device)
                v[:, i, :, L - lengths[i]:] = kv[1].to(device)
                held[i, L - lengths[i]:] = 1
        for layer in range(layers):
            cache.update(k[layer], v[layer], layer)
        mask = torch.cat([held, mask], dim=1)
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
    """An engine that decodes with a module in this process. Built on the trainer's own
    policy (``shares_weights``) it reads nothing of a sync's stream: the weights are the
    trainer's, already updated in place. Built on a module of its own (a sharded run's
    plain copy), a sync copies the stream into it, one tensor at a time, and :meth:`sleep`
    frees what the syncs refill (the tensors training changes) while the trainer updates:
    the copy exists from a sync to the end of the next rollout, never during the update."""

    partial_sync = True

    def __init__(self, model, tokenizer, shares_weights: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.shares_weights = shares_weights
        self._prefixes = Prefixes()  # (on inside reusing_prefixes())
        self._refilled: dict[str, torch.Size] = {}  # name -> shape of what a sync sends
        self._freed = False  # sleep() emptied the tensors of _refilled

    @property
    def needs_sync(self) -> bool:
        return self._freed

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if not self.shares_weights:
            own = dict(self.model.named_parameters())
            seen: dict[str, torch.Size] = {}
            with torch.no_grad():
                for name, tensor in weights:
                    if name in own:
                        p = own[name]
                        if self._freed and name in self._refilled:
                            p.data = torch.empty(self._refilled[name], dtype=p.dtype,
                                                 device=p.device)
                        p.copy_(tensor)
                        seen[name] = p.shape
            missing = self._refilled.keys() - seen.keys() if self._freed else set()
            if missing:
                raise RuntimeError("the weight stream left out tensors the engine freed: "
                                   f"{sorted(missing)[:3]}")
            self._refilled, self._freed = seen, False
        self.version = version

    def sleep(self) -> None:
        """Free the tensors the last sync refilled (none before the first sync: the copy
        the engine was built with stays until a sync has shown what it sends)."""
        if self.shares_weights or self.model is None or self._freed or not self._refilled:
            return
        for name, p in self.model.named_parameters():
            if name in self._refilled:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._freed = True

    @contextlib.contextmanager
    def reusing_prefixes(self, managed: bool = False):
        """Within it, each call keeps every sample's keys and values, and a later call
        runs only what a request adds to one of them (an episode's next turn: the last
        sampled token, the environment's message, the generation prompt); a kept sequence
        is released once extended (``managed``: once :meth:`retain_prefixes` leaves it
        out), the rest when the block ends (at most one per episode). The reused keys and
        values are the decode steps' own, so a sample's log-probs differ from a full
        prefill's by float rounding."""
        self._prefixes = Prefixes(on=True, managed=managed)
        try:
            yield self
        finally:
            self._prefixes = Prefixes()

    def retain_prefixes(self, sequences) -> None:
        self._prefixes.retain(sequences)

    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
        from posttrain.rollout.guard import trainer_logprobs

        return trainer_logprobs(self.model, sequences, prompt_lens)

    def close(self) -> None:
        self.model = None

    def decoder(self, cache, n: int, max_len: int, mask: torch.Tensor, pos: torch.Tensor,
                capture: bool):
        """The object that runs one decode step (``step(tokens) -> logits``, ``select(rows)``,
        ``activations(columns, end)``: the projections' outputs when ``capture``) over the
        prefilled ``cache``."""
        raise NotImplementedError

    @torch.no_grad()
    def generate(self, requests: list[Request], n: int = 1,
                 params: SamplingParams | None = None,
                 generator: torch.Generator | None = None,
                 extras: frozenset[str] = frozenset()) -> Rollout:
        """Sample ``n`` completions for each request (see the module docstring). ``extras``:
        what to keep in ``Rollout.cache`` of what this engine lists in its ``extras``
        (others are ignored). Sample ``j`` of request ``i`` picks its token ``t`` with the
        ``t``-th uniform number of its own seed's stream (:func:`request_uniforms`), so
        each sample's draws are its own whatever else is in the batch; requests without
        a seed draw from ``generator``. ``head_stats`` is kept with plain sampling only
        (temperature > 0, no top-k / top-p)."""
        model, tokenizer = self.model, self.tokenizer
        params = params or SamplingParams()
        params.validate()
        device = compute_device(model)
        pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        prompt_ids = [list(r.prompt_ids) for r in requests]
        P, Lp = len(prompt_ids), max(len(x) for x in prompt_ids)
        N, T = P * n, params.max_new_tokens
        uniforms = request_uniforms(requests, n, T) if params.temperature > 0 else None

        if uniforms is not None:
            uniforms = uniforms.to(device)
        was_training = model.training
        model.eval()
        past = self._prefixes.find(prompt_ids)
        recorder = None  # R3: the experts of every token fed (mixture-of-experts samplers)
        if "routing" in extras:
            from posttrain.models import routing

            if routing.is_moe(model):
                recorder = routing.RolloutRecorder(model, [len(p) for p in prompt_ids], n,
                                                   Lp + T)
                run = _past_lengths(past, P)  # (the prefill runs what is not held)
                recorder.prefill(max(len(p) - h for p, h in zip(prompt_ids, run,
                                                                strict=True)), run)
        cache, logits, mask, next_pos = _prefill(model, prompt_ids, n, pad_id, device, past)
        Lp = mask.shape[1]  # the cache's columns before decoding (with a reused past)
        extras = extras & self.extras
        held: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(slots: torch.Tensor, rows: torch.Tensor, t: int) -> None:
            """Keep the keys and values of ``rows`` (in cache ``slots``), whose last
            sampled token is column ``t``: the prompt's columns and the tokens fed."""
            if not self._prefixes.on:
                return
            k, v = decoder.kv(slots, Lp + t)  # (layers, rows, heads, cols, dim)
            for j, r in enumerate(rows.tolist()):
                cols = torch.cat([mask[r].nonzero().squeeze(-1),
                                  torch.arange(Lp, Lp + t, device=mask.device)])
                seq = tuple(prompt_ids[r // n]) + tuple(tokens[r, :t].tolist())
                held[seq] = (k[:, j][:, :, cols].clone(), v[:, j][:, :, cols].clone())

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
                keep(finished.nonzero().squeeze(-1), rows, t)
                kept = compaction(~finished)
                if len(kept) == 0 or t == T - 1:
                    if len(kept):  # the budget's end: the rows still running too
                        keep((~finished).nonzero().squeeze(-1),
                             (torch.arange(N, device=device) if active is None
                              else active)[~finished], t)
                    break
                decoder.select(kept)
                active = kept if active is None else active[kept]
                tok = tok[kept]
            if t == T - 1:
                live = torch.arange(N, device=device) if active is None else active
                keep(torch.arange(len(live), device=device), live, t)
                break
            if recorder is not None:
                recorder.step(torch.arange(N, device=device) if active is None else active, t)
            logits = decoder.step(tok)
        model.train(was_training)
        if self._prefixes.on:  # (what no call extended stays until released)
            self._prefixes.settle(held)
        activations = decoder.activations(steps, end.clamp_max(steps - 1))
        if head is not None:
            head = _head_stats(head[:, :, :steps], end.clamp_max(steps - 1))
        rollout = self._finish(prompt_ids, n, tokens[:, :steps], logps[:, :steps], done, end,
                               params.stop)
        if recorder is not None:
            rollout.routing = recorder.result()
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
                       texts=texts, policy_version=self.version)
