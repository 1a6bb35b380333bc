"""What a rollout engine takes and returns: :class:`Request` (token ids and a seed),
:class:`SamplingParams` and :class:`Rollout` (completion ids, behaviour log-probs, finish
reasons, the policy version), and the batch operations on rollouts (select rows,
concatenate rounds)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Request:
    """One prompt to sample from: its token ids (the trainer tokenises once, chat template
    applied where it has one) and its own seed. Sample ``j`` of the request draws from
    :func:`sample_seed` ``(seed, j)`` alone, so what a sample is depends neither on the
    other requests of a batch nor on how requests are spread over ranks; None: the
    engine's own randomness (a one-off ``generator``)."""

    prompt_ids: tuple[int, ...]
    seed: int | None = None


def stream_seed(*parts) -> int:
    """A 63-bit seed from ``parts`` (ints or strings), the same on every machine."""
    text = "posttrain-sampling/" + "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def sample_seed(request_seed: int, sample: int) -> int:
    """The seed of sample ``sample`` of a request seeded ``request_seed``."""
    return stream_seed(request_seed, sample)


def requests_for(tokenizer, prompts: list[str], seeds: list[int] | None = None
                 ) -> list[Request]:
    """:class:`Request` s of text prompts, tokenised once (plain text, no template)."""
    seeds = seeds if seeds is not None else [None] * len(prompts)
    return [Request(tuple(tokenizer(p)["input_ids"]), s) for p, s in zip(prompts, seeds,
                                                                         strict=True)]


@dataclass
class SamplingParams:
    """How completions are sampled."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be ≥ 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("top_k must be ≥ 0 and max_new_tokens ≥ 1")

@dataclass
class Rollout:
    """``N = P·G`` sampled completions; rows of one prompt are contiguous."""

    prompt_ids: list[list[int]]
    """Token ids of each sample's prompt (no padding), length N."""
    completion_ids: torch.Tensor
    """(N, Tc) generated tokens, right-padded with the pad id."""
    completion_mask: torch.Tensor
    """(N, Tc) 1 on generated tokens (including a closing eos)."""
    logprobs: torch.Tensor
    """(N, Tc) the **behaviour log-probs**: each generated token's log-probability under
    the distribution it was actually drawn from (temperature, top-k and top-p applied), as
    the engine computed it; 0 past the completion."""
    truncated: torch.Tensor
    """(N,) True where the token budget ran out before eos or a stop string (finish
    reason ``length``; ``stop`` otherwise)."""
    group_ids: torch.Tensor
    """(N,) index of the prompt each sample came from."""
    texts: list[str]
    """Decoded completions without special tokens (cut at a stop string)."""
    policy_version: int = 0
    """The version of the weights that sampled it (the engine's last :meth:`sync`)."""
    loss_mask: torch.Tensor | None = None
    """(N, Tc) 1 on the tokens the policy sampled and the loss trains, where that differs
    from ``completion_mask``: an episode's completion holds the environment's messages too
    (``posttrain.episodes``); None: every completion token was sampled."""
    routing: torch.Tensor | None = None
    """(N, routers, positions, k) the experts each token of a sample's sequence (prompt
    from position 0, then the completion) went to while sampling, -1 where none was
    recorded (mixture-of-experts samplers asked for ``routing``; R3)."""
    versions: torch.Tensor | None = None
    """(N, Tc) the policy version that sampled each completion token, where they differ
    within a sample (partial rollouts: an episode's later turns under newer weights); None:
    every token is ``policy_version``'s."""
    stats: dict[str, torch.Tensor] | None = None
    """Per-sample numbers ``(N,)`` the step's metrics average (an episode's turns, its
    environment's seconds and counters); None for none."""
    cache: Any = None
    """What the engine computed while sampling that the update may reuse (an opaque,
    version-checked ``posttrain.fast.cache.SamplerCache``, asked for with ``extras``); None
    when nothing was kept. Rows are selected with its ``rows``, rounds joined with its
    ``concat``; nothing here looks inside."""

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)

    @property
    def trained_mask(self) -> torch.Tensor:
        """(N, Tc) 1 on the sampled tokens (those the loss trains)."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    def sequences(self) -> tuple[list[list[int]], list[int]]:
        """Each sample as prompt + completion token ids, and its prompt's length."""
        seqs = [list(p) + c[m.bool()].tolist() for p, c, m in
                zip(self.prompt_ids, self.completion_ids, self.completion_mask, strict=True)]
        return seqs, [len(p) for p in self.prompt_ids]

    @property
    def finish_reasons(self) -> list[str]:
        """Each sample's finish reason: ``stop`` (eos or a stop string) or ``length``."""
        return ["length" if t else "stop" for t in self.truncated.tolist()]

def select(r: Rollout, rows: torch.Tensor) -> Rollout:
    """The samples ``rows`` (indices, in order) of a rollout; group ids are kept."""
    idx = rows.tolist()
    return Rollout(prompt_ids=[r.prompt_ids[i] for i in idx], completion_ids=r.completion_ids[rows],
                   completion_mask=r.completion_mask[rows], logprobs=r.logprobs[rows],
                   truncated=r.truncated[rows], group_ids=r.group_ids[rows],
                   texts=[r.texts[i] for i in idx], policy_version=r.policy_version,
                   loss_mask=None if r.loss_mask is None else r.loss_mask[rows],
                   stats=None if r.stats is None else {k: v[rows] for k, v in r.stats.items()},
                   routing=None if r.routing is None else r.routing[rows],
                   versions=None if r.versions is None else r.versions[rows],
                   cache=None if r.cache is None else r.cache.rows(rows))

def concat(rollouts: list[Rollout], pad_id: int, width: int = 0) -> Rollout:
    """One rollout from several; completions are re-padded to the longest (or ``width``
    columns, if more), and group ids renumbered so groups stay distinct."""
    T = max(width, *(r.completion_ids.shape[1] for r in rollouts))

    def pad(x: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)

    offset, groups = 0, []
    for r in rollouts:
        _, ids = torch.unique(r.group_ids, return_inverse=True)
        groups.append(ids + offset)
        offset += int(ids.max()) + 1 if len(ids) else 0
    return Rollout(
        prompt_ids=[p for r in rollouts for p in r.prompt_ids],
        completion_ids=torch.cat([pad(r.completion_ids, pad_id) for r in rollouts]),
        completion_mask=torch.cat([pad(r.completion_mask, 0) for r in rollouts]),
        logprobs=torch.cat([pad(r.logprobs, 0.0) for r in rollouts]),
        truncated=torch.cat([r.truncated for r in rollouts]),
        group_ids=torch.cat(groups),
        texts=[t for r in rollouts for t in r.texts],
        policy_version=min(r.policy_version for r in rollouts),
        loss_mask=(None if all(r.loss_mask is None for r in rollouts) else
                   torch.cat([pad(r.trained_mask, 0) for r in rollouts])),
        stats=_concat_stats(rollouts),
        routing=_concat_routing([r.routing for r in rollouts]),
        versions=(None if all(r.versions is None for r in rollouts) else
                  torch.cat([pad(r.versions if r.versions is not None else
                                 torch.full_like(r.completion_ids, r.policy_version), 0)
                             for r in rollouts])),
        cache=_concat_caches([r.cache for r in rollouts], T))


def _concat_routing(parts: list) -> torch.Tensor | None:
    """The rounds' recorded routing, padded with -1 to the widest; None unless every round
    has one."""
    if not parts or any(p is None for p in parts):
        return None
    W = max(p.shape[2] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, W - p.shape[2]), value=-1)
                      for p in parts])


def _concat_stats(rollouts: list[Rollout]) -> dict[str, torch.Tensor] | None:
    """The rounds' per-sample stats joined (0 for a key a round lacks)."""
    if all(r.stats is None for r in rollouts):
        return None
    keys = sorted({k for r in rollouts if r.stats for k in r.stats})
    return {k: torch.cat([r.stats[k].double() if r.stats and k in r.stats
                          else torch.zeros(len(r.truncated), dtype=torch.float64)
                          for r in rollouts]) for k in keys}


def _concat_caches(parts: list, T: int):
    """The rounds' caches as one (their own ``concat``), or None unless every round has
    one."""
    if not parts or any(p is None for p in parts):
        return None
    return type(parts[0]).concat(parts, T)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]
