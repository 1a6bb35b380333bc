"""A step's samples in the token layout the update, old, reference and critic passes share.

Every per-token tensor is ``(N, Lc)``, one column per generated token (masks, advantages,
old and reference log-probs). With ``share_prompt`` each group's prompt runs once and its
keys and values serve the group's completions (``posttrain.models.shared_prompt``); without,
each sample is a full prompt + completion sequence.
"""

from __future__ import annotations

import contextlib

import torch

from posttrain import data as data_mod
from posttrain.models import (
    completion_apply,
    completion_logprobs,
    packing_pays,
    shared_prompt_hidden,
    shared_prompt_logprobs,
    value_head,
)
from posttrain.packing import decide_packing
from posttrain.rollout import Rollout


class TokenBatch:
    """A step's samples in the completion layout (see the module docstring).

    ``cache`` is the rollout's sampler cache (shared-prompt layout only; opaque here:
    ``posttrain.fast.cache``), taken over from the rollout (which no longer holds it, so
    that it is freed as soon as it is used up): while the policy is unchanged since
    sampling, its passes with ``reuse=True`` take what it holds instead of recomputing it
    (the cache refuses once the policy has taken an optimiser step). The pass that precedes
    a change of the policy releases it (``last_use``).
    """

    def __init__(self, rollout: Rollout, pad_id: int, device, share_prompt: bool,
                 temperature: float = 1.0, packing: bool | None = False,
                 budget: int | None = None):
        self.temperature = temperature
        """Every log-prob pass divides the logits by the sampling temperature, so the update,
        old and reference log-probs are of the distribution that sampled (top-k / top-p
        truncation is not applied: the sampler's log-probs include it)."""
        self.share = share_prompt
        self.routing = None
        """The policy's :class:`~posttrain.models.routing.Routing` for this batch (MoE, whole
        sequences), and what its passes do with it now (``routing_mode``: record, replay,
        compare, observe; None: nothing)."""
        self.routing_mode: str | None = None
        self.cache = rollout.cache.to(device) if share_prompt and rollout.cache else None
        rollout.cache = None
        self.completion_ids = rollout.completion_ids.to(device)
        self.completion_mask = rollout.completion_mask.to(device)
        if share_prompt:
            groups, index = torch.unique(rollout.group_ids, return_inverse=True)
            rows = torch.arange(len(index))
            first = torch.full((len(groups),), len(index)).scatter_reduce(
                0, index, rows, reduce="amin")  # first sample of each group
            ids, mask = data_mod.pad_left([rollout.prompt_ids[i] for i in first.tolist()],
                                          pad_id)
            self.prompt_ids, self.prompt_mask = ids.to(device), mask.to(device)
            self.prompt_index = index.to(device)
            self.packed = None  # decided per model, once for the whole batch (_packed_for)
        else:
            completions = [r[m.bool()].tolist() for r, m in
                           zip(rollout.completion_ids, rollout.completion_mask, strict=True)]
            full = data_mod.pad_sequences(rollout.prompt_ids, completions, pad_id)
            self.full = {k: v.to(device) for k, v in full.items()}
            self.prompt_lengths = torch.tensor([len(p) for p in rollout.prompt_ids],
                                               device=device)
        self.pad_id = pad_id
        self.packing, self.budget = (False, budget) if share_prompt else decide_packing(
            packing, budget, [[[n] for n in self.full["attention_mask"].sum(-1).tolist()]],
            self.full["input_ids"].shape[1])
        """Full sequences run packed, without padding (``--packing``, or left unset when
        packed they would run at most :data:`~posttrain.packing.PACK_BELOW` of this batch's
        padded tokens, rows capped at its longest sequence): each pass packs its rows
        (:meth:`_pack`)."""
        self.forward_tokens = budget if self.packing else None
        """The ``max_tokens_per_micro_batch`` given, where the batch packs: the most tokens
        one forward of the update and of the passes runs (one packed row; see
        :func:`~posttrain.trainers.online.update.micro_batches`)."""

    def lengths(self, rows: torch.Tensor) -> torch.Tensor:
        """The full sequences' tokens of ``rows`` (full-sequence layout)."""
        return self.full["attention_mask"][rows].sum(-1)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def _packed_for(self, model) -> bool:
        """One packing decision for the whole batch (see :func:`shared_prompt_logprobs`), so
        the old, reference, critic and update passes all take the same path and the first
        update's ratio is exactly 1 in any precision. A packed call replays nothing, so the
        sampler's saved projections are dropped then."""
        if self.packed is None:
            self.packed = packing_pays(model, self.prompt_mask, self.completion_mask,
                                     self.prompt_index)
            if self.packed and self.cache is not None:
                self.cache = self.cache.without_projections()
        return self.packed

    def _shared(self, model, rows: torch.Tensor) -> tuple[tuple, dict]:
        """Arguments of :func:`shared_prompt_logprobs`/:func:`shared_prompt_hidden` for the
        completions ``rows``: the prompts they use, renumbered, and the batch's packing."""
        groups, index = torch.unique(self.prompt_index[rows], return_inverse=True)
        args = (self.prompt_ids[groups], self.prompt_mask[groups], self.completion_ids[rows],
                self.completion_mask[rows])
        return args, {"prompt_index": index, "packed": self._packed_for(model)}

    def logprobs(self, model, rows: torch.Tensor, with_entropy: bool = False,
                 reuse: bool = False, last_use: bool = False):
        """Log-probs (and entropy) of the completions of ``rows``, ``(len(rows), Lc)``.
        ``reuse``: ``model`` is the policy that sampled the rollout, unchanged since; what
        the sampler's cache holds is used if there is one. ``last_use``: and this is its
        last use, so it is released first (what the backward does not need of the saved
        projections is freed layer by layer during the forward)."""
        if self.share:
            args, kw = self._shared(model, rows)
            if reuse and self.cache is not None:
                cache = self.cache
                if last_use:
                    self.cache = None
                got = cache.take(model, rows, self.completion_ids.shape[1],
                                 replay=not kw["packed"])
                del cache
                kw["replay"], kw["known_head"] = got.replay, got.head
            return shared_prompt_logprobs(model, *args, with_entropy=with_entropy,
                                          temperature=self.temperature, **kw)
        if self.packing:
            packed, where, start = self._pack(rows)
            out = completion_logprobs(model, packed["input_ids"], None, packed["loss_mask"],
                                      with_entropy=with_entropy, temperature=self.temperature,
                                      position_ids=packed["position_ids"])
        else:
            with self._routing(rows):
                out = completion_logprobs(model, self.full["input_ids"][rows],
                                          self.full["attention_mask"][rows],
                                          self.full["loss_mask"][rows],
                                          with_entropy=with_entropy,
                                          temperature=self.temperature)
            where, start = None, 0
        outs = out if with_entropy else (out,)
        # completion token j of a row sits at sequence position len(prompt) + j, so its
        # log-prob is column len(prompt) + j - 1 of the (T - 1) layout (packed: of its
        # packed row, after the sequences before it)
        Lc = self.completion_ids.shape[1]
        cols = (start + self.prompt_lengths[rows])[:, None] - 1 + torch.arange(
            Lc, device=rows.device)
        mask = self.completion_mask[rows].bool()
        cols = cols.clamp_max(outs[0].shape[1] - 1)
        res = [torch.where(mask, (x if where is None else x[where]).gather(1, cols), 0.0)
               for x in outs]
        return tuple(res) if with_entropy else res[0]

    def _pack(self, rows: torch.Tensor):
        """``rows``' full sequences packed (:func:`posttrain.data.pack_sequences`, in row
        order): the packed batch, and each row's packed row and first column."""
        ids = self.full["input_ids"][rows].tolist()
        lengths = self.lengths(rows).tolist()
        starts = self.prompt_lengths[rows].tolist()
        packed = data_mod.pack_sequences([x[:p] for x, p in zip(ids, starts, strict=True)],
                                         [x[p:n] for x, p, n in zip(ids, starts, lengths,
                                                                    strict=True)],
                                         self.pad_id, budget=self.budget)
        device = rows.device
        packed = {k: v.to(device) for k, v in packed.items()}
        ends = packed["ends"]
        return packed, ends[:, 0], ends[:, 1] - torch.tensor(lengths, device=device) + 1

    def _routing(self, rows: torch.Tensor):
        """The routing context of a forward of ``rows`` (a no-op without one); rows never
        recorded (a rank's stand-in forward) are observed, not replayed."""
        if self.routing is None or self.routing_mode is None:
            return contextlib.nullcontext()
        mode = self.routing_mode
        if mode in ("replay", "compare") and not self.routing.has(rows):
            mode = "observe"
        return self.routing.call(rows, self.full["attention_mask"][rows], mode)

    def router_aux_loss(self):
        """The last forward's auxiliary load-balancing loss (MoE, whole sequences), or
        None."""
        return None if self.routing is None else self.routing.aux_loss()

    def release_sampler_cache(self) -> None:
        """Drop the sampler's cache (the policy has moved; a rank whose rows of a minibatch
        were all dead never made the releasing call)."""
        self.cache = None

    def values(self, critic, rows: torch.Tensor) -> torch.Tensor:
        """The critic's ``V(x, y_<t)`` for each completion token of ``rows``,
        ``(len(rows), Lc)``: its value head on the hidden state that precedes the token (the
        state the policy acts in), 0 where the mask is 0."""
        mask = self.completion_mask[rows]
        if self.share:
            args, kw = self._shared(critic, rows)
            hidden = shared_prompt_hidden(critic, *args, **kw)
            v = value_head(critic)(hidden).squeeze(-1).float()  # (N,)
        else:
            def head(h):
                return value_head(critic)(h).squeeze(-1).float()

            if self.packing:  # (packed in row order: the completions' tokens in order)
                packed = self._pack(rows)[0]
                v = completion_apply(critic, packed["input_ids"], None, packed["loss_mask"],
                                     head, packed["position_ids"])
            else:
                v = completion_apply(critic, self.full["input_ids"][rows],
                                     self.full["attention_mask"][rows],
                                     self.full["loss_mask"][rows], head)
        target = mask.bool()
        return torch.zeros(target.shape, dtype=v.dtype, device=v.device).masked_scatter(target, v)
