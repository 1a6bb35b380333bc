"""Batched sampling from a policy with a KV cache: the rollout engine of the online trainers.

For P prompts and G samples each, we prefill the P (left-padded) prompts once, repeat the
cache G times, and decode token by token with a lean loop: one forward of the active rows
per step, temperature / top-k / top-p on the last logits only, and rows that finished (eos,
a stop string, or the token budget) are dropped from the cache so later steps run on fewer
rows. ``transformers.generate`` does the same sampling with more per-token machinery (logits
processors, stopping criteria objects, a padded batch to the end); for small models that
overhead is most of the time.

Sampling log-probabilities are those of the distribution actually sampled from (after
temperature, top-k and top-p); with ``temperature=1`` and no truncation they equal the
policy's log-probabilities of the tokens, up to floating-point differences between the
incremental and the full forward.

The engine is one function with a narrow contract (prompts in, :class:`Rollout` out) so a
vLLM backend can stand in its place on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from posttrain.modeling import cache_kwarg


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
    """(N, Tc) log-probability of each generated token under the sampling distribution."""
    truncated: torch.Tensor
    """(N,) True where the token budget ran out before eos or a stop string."""
    group_ids: torch.Tensor
    """(N,) index of the prompt each sample came from."""
    texts: list[str]
    """Decoded completions without special tokens (cut at a stop string)."""

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)


def _sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits`` (R, V); return (tokens, log-probs)."""
    logits = logits.float()
    if p.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.zeros_like(tokens, dtype=torch.float32)
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
    logp = logits.log_softmax(-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], n: int = 1,
             params: SamplingParams | None = None, generator: torch.Generator | None = None
             ) -> Rollout:
    """Sample ``n`` completions for each prompt (see the module docstring)."""
    params = params or SamplingParams()
    params.validate()
    device = next(model.parameters()).device
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    P, Lp = len(prompt_ids), max(len(x) for x in prompt_ids)
    N, T = P * n, params.max_new_tokens

    ids = torch.full((P, Lp), pad_id, dtype=torch.long)
    mask = torch.zeros(P, Lp, dtype=torch.long)
    for i, x in enumerate(prompt_ids):  # left padding: every prompt ends at column Lp-1
        ids[i, Lp - len(x):] = torch.tensor(x)
        mask[i, Lp - len(x):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)

    was_training = model.training
    model.eval()
    cache = DynamicCache()
    kw = cache_kwarg(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                use_cache=True, logits_to_keep=1, **{kw: cache})
    logits = out.logits[:, -1].repeat_interleave(n, dim=0)  # (N, V)
    cache.batch_repeat_interleave(n)
    mask = mask.repeat_interleave(n, dim=0)
    next_pos = positions[:, -1].repeat_interleave(n) + 1

    tokens = torch.full((N, T), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(N, T, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    end = torch.full((N,), T - 1, dtype=torch.long, device=device)  # last step of each row
    active = torch.arange(N, device=device)  # rows still in the cache, in cache order
    stop = params.stop
    steps = 0
    for t in range(T):
        tok, lp = _sample(logits, params, generator)
        tokens[active, t] = tok
        logps[active, t] = lp
        steps = t + 1
        finished = tok == eos_id
        if stop:
            for j, row in enumerate(active.tolist()):
                if not finished[j]:
                    text = tokenizer.decode(tokens[row, :t + 1], skip_special_tokens=True)
                    finished[j] = any(s in text for s in stop)
        done[active[finished]] = True
        end[active[finished]] = t
        keep = ~finished
        if not keep.any() or t == T - 1:
            break
        if not keep.all():
            keep_idx = keep.nonzero().squeeze(-1)
            cache.batch_select_indices(keep_idx)
            active, tok, mask, next_pos = (active[keep_idx], tok[keep_idx], mask[keep_idx],
                                           next_pos[keep_idx])
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    use_cache=True, **{kw: cache})
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    model.train(was_training)

    tokens, logps = tokens[:, :steps].cpu(), logps[:, :steps].cpu()
    done, end = done.cpu(), end.cpu().clamp_max(steps - 1)
    # a row's completion runs up to and including the token that finished it (its first eos
    # or the one completing a stop string), else to the end; it is pad from there on
    cols = torch.arange(steps)
    completion_mask = (cols[None, :] <= end[:, None]).long()
    if steps == 0:
        completion_mask = completion_mask[:, :0]
    tokens = tokens.masked_fill(completion_mask == 0, pad_id)
    logps = logps.masked_fill(completion_mask == 0, 0.0)
    texts = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    if stop:
        texts = [_cut_at_stop(x, stop) for x in texts]
    return Rollout(prompt_ids=[x for x in prompt_ids for _ in range(n)],
                   completion_ids=tokens, completion_mask=completion_mask, logprobs=logps,
                   truncated=~done, group_ids=torch.arange(P).repeat_interleave(n),
                   texts=texts)


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def select(r: Rollout, rows: torch.Tensor) -> Rollout:
    """The samples ``rows`` (indices, in order) of a rollout; group ids are kept."""
    idx = rows.tolist()
    return Rollout(prompt_ids=[r.prompt_ids[i] for i in idx], completion_ids=r.completion_ids[rows],
                   completion_mask=r.completion_mask[rows], logprobs=r.logprobs[rows],
                   truncated=r.truncated[rows], group_ids=r.group_ids[rows],
                   texts=[r.texts[i] for i in idx])


def concat(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout from several; completions are re-padded to the longest, and group ids
    renumbered so groups stay distinct."""
    T = max(r.completion_ids.shape[1] for r in rollouts)

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
        texts=[t for r in rollouts for t in r.texts])
