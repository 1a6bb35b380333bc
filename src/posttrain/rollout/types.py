"""What a rollout engine takes and returns: :class:`Request` (token ids and a seed; the
seeds of requests and of their samples, and the uniform numbers those draw),
:class:`SamplingParams` and :class:`Rollout` (completion ids, behaviour log-probs, finish
reasons, the policy version), and the batch operations on rollouts (select rows,
concatenate rounds, leave out what stays in the process), each derived from the kinds the
fields declare (:mod:`posttrain.rollout.record`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.rollout import record


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


def request_seed(seed: int, step: int, round_: int, slot: int) -> int:
    """The seed of the request for prompt slot ``slot`` of an RL step's sampling round: from
    ``(seed, step, round, slot)`` alone, so the samples drawn depend neither on how the
    prompts are spread over ranks nor on what else a batch holds."""
    return stream_seed(seed, step, round_, slot)


def request_uniforms(requests: list[Request], n: int, columns: int) -> torch.Tensor | None:
    """The uniform numbers ``(len·n, columns)`` that pick each sample's tokens: row
    ``i·n + j`` from a generator seeded by ``sample_seed(requests[i].seed, j)``; None when
    any request has no seed (the engine's generator draws then)."""
    if any(r.seed is None for r in requests):
        return None
    out = torch.empty(len(requests) * n, columns)
    gen = torch.Generator()
    for i, r in enumerate(requests):
        for j in range(n):
            gen.manual_seed(sample_seed(r.seed, j))
            out[i * n + j] = torch.rand(columns, generator=gen)
    return out


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

def _sampled_tokens(r: Rollout) -> torch.Tensor:
    """What stands for a missing ``loss_mask`` when rounds are joined: every completion
    token was sampled."""
    return r.completion_mask


def _sampled_by_its_version(r: Rollout) -> torch.Tensor:
    """What stands for missing ``versions`` when rounds are joined: every token is
    ``policy_version``'s."""
    return torch.full_like(r.completion_ids, r.policy_version)


def _one_row_each(r: Rollout) -> torch.Tensor:
    """What stands for missing ``sample_ids`` when records are joined: a sample per row."""
    return torch.arange(len(r.prompt_ids))


@dataclass
class Rollout:
    """``N = P·G`` sampled completions; rows of one prompt are contiguous.

    Each field states its kind (``metadata``: :mod:`posttrain.rollout.record`), from which
    :func:`select`, :func:`concat`, :func:`portable` and the checkpoint's
    :func:`~posttrain.rollout.record.to_state` follow; a new field states its own."""

    prompt_ids: list[list[int]] = field(metadata=record.row_list())
    """Token ids of each sample's prompt (no padding), length N."""
    completion_ids: torch.Tensor = field(metadata=record.row_tensor(record.PAD_ID))
    """(N, Tc) generated tokens, right-padded with the pad id."""
    completion_mask: torch.Tensor = field(metadata=record.row_tensor(0))
    """(N, Tc) 1 on generated tokens (including a closing eos)."""
    logprobs: torch.Tensor = field(metadata=record.row_tensor(0.0))
    """(N, Tc) the **behaviour log-probs**: each generated token's log-probability under
    the distribution it was actually drawn from (temperature, top-k and top-p applied), as
    the engine computed it; 0 past the completion."""
    truncated: torch.Tensor = field(metadata=record.row_vector())
    """(N,) True where the token budget ran out before eos or a stop string (finish
    reason ``length``; ``stop`` otherwise)."""
    group_ids: torch.Tensor = field(metadata=record.row_vector(renumber=True))
    """(N,) index of the prompt each sample came from."""
    texts: list[str] = field(metadata=record.row_list())
    """Decoded completions without special tokens (cut at a stop string)."""
    policy_version: int = field(default=0, metadata=record.scalar(min, saved_as="version"))
    """The version of the weights that sampled it (the engine's last :meth:`sync`); joined
    rounds: the oldest."""
    loss_mask: torch.Tensor | None = field(
        default=None, metadata=record.row_tensor(0, stand_in=_sampled_tokens))
    """(N, Tc) 1 on the tokens the policy sampled and the loss trains, where that differs
    from ``completion_mask``: an episode's completion holds the environment's messages too
    (``posttrain.episodes``); None: every completion token was sampled."""
    routing: torch.Tensor | None = field(
        default=None, metadata=record.row_tensor(-1, dim=2, to="widest"))
    """(N, routers, positions, k) the experts each token of a sample's sequence (prompt
    from position 0, then the completion) went to while sampling, -1 where none was
    recorded (mixture-of-experts samplers asked for ``routing``; R3). Joined rounds have
    it only if every round has."""
    versions: torch.Tensor | None = field(
        default=None, metadata=record.row_tensor(0, stand_in=_sampled_by_its_version))
    """(N, Tc) the policy version that sampled each completion token, where they differ
    within a sample (partial rollouts: an episode's later turns under newer weights); None:
    every token is ``policy_version``'s."""
    sample_ids: torch.Tensor | None = field(
        default=None, metadata=record.row_vector(renumber=True, stand_in=_one_row_each))
    """(N,) rows of one sample share an id: the trajectories of an agent episode whose
    history was rewritten (``posttrain.agents``), each trained on its own tokens with the
    episode's reward, the episode counted once in its group's statistics; None: a row per
    sample."""
    stats: dict[str, torch.Tensor] | None = field(default=None, metadata=record.row_dict())
    """Per-sample numbers ``(N,)`` the step's metrics average (an episode's turns, its
    environment's seconds and counters); None for none."""
    cache: Any = field(default=None, metadata=record.opaque())
    """What the engine computed while sampling that the update may reuse (an opaque,
    version-checked ``posttrain.fast.cache.SamplerCache``, asked for with ``extras``); None
    when nothing was kept. Rows are selected with its ``rows``, rounds joined with its
    ``concat``; nothing here looks inside, and it is neither gathered to other ranks nor
    checkpointed."""

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


record.parts(Rollout)  # (a field that does not state its kind fails here, at import)


def select(r: Rollout, rows: torch.Tensor) -> Rollout:
    """The samples ``rows`` (indices, in order) of a rollout; group ids are kept."""
    return record.select(r, rows)


def concat(rollouts: list[Rollout], pad_id: int, width: int = 0) -> Rollout:
    """One rollout from several; completions are re-padded to the longest (or ``width``
    columns, if more), and group ids renumbered so groups stay distinct."""
    return record.concat(rollouts, pad_id, width)


def portable(r: Rollout) -> Rollout:
    """The rollout without its sampler cache (and any other opaque field): what is sent to
    other ranks."""
    return record.portable(r)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]
