"""Shared-prompt layouts: the log-probabilities (or hidden states) of ``k`` completions per
prompt with the prompt run once, and the one decision of whether a run shares prompts.

Two layouts compute the same thing (tested against full sequences, values and gradients):
one packed forward call with a custom 4-D mask, or two calls (prompts, then completions over
their KV cache). :func:`packing_pays` picks by cost; a model with sliding-window attention
never gets a packed row longer than its window (the custom mask would bypass the window).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from posttrain.models.loading import active_parameters, backbone, for_device
from posttrain.models.logprobs import has_plain_head, head_logprobs


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
                           with_entropy: bool = False, packed: bool | None = None,
                           replay: contextlib.AbstractContextManager | None = None,
                           temperature: float = 1.0, known_head: torch.Tensor | None = None):
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

    Two ways to run it (``packed``; ``None`` picks by cost, see :func:`packing_pays`):

    - *packed*: one forward call. Row ``i`` holds prompt ``i`` followed by all its
      completions, without padding between them; a 4-D attention mask lets each completion
      see the prompt and itself only, and position ids restart after the prompt for each
      completion. Every weight is read once and its gradient is one matmul, at the price of
      a dense attention over the whole row (wasted on masked entries).
    - *two calls*: the prompts, then the completions over a KV cache of the prompts repeated
      to each completion. Attention is exact-sized, but each weight is used twice.

    ``replay``: a context the completion call runs in, which then takes the two-call path
    (``posttrain.fast.replay``: the sampler's projection outputs stand in for its matmuls).
    ``known_head`` ``(2, k·B, Lc)``: with it, the sampler's log-sum-exp and entropy at each
    completion token stand in for the head's own forward.
    """
    if not has_plain_head(model):
        raise ValueError("shared_prompt_logprobs needs a model with output embeddings")
    hidden = shared_prompt_hidden(model, prompt_ids, prompt_mask, completion_ids,
                                  completion_mask, prompt_index, packed, replay)
    target = completion_mask.bool()
    if known_head is not None:  # (2, k·B, Lc) → (2, N) at the completion tokens
        known_head = known_head[:, target]
    return head_logprobs(model, hidden, completion_ids[target], target, with_entropy,
                         temperature, known_head)

def shared_prompt_hidden(model: PreTrainedModel, prompt_ids: torch.Tensor,
                         prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                         completion_mask: torch.Tensor,
                         prompt_index: torch.Tensor | None = None,
                         packed: bool | None = None,
                         replay: contextlib.AbstractContextManager | None = None
                         ) -> torch.Tensor:
    """The hidden states behind :func:`shared_prompt_logprobs` (same arguments): the last
    hidden state predicting each completion token, ``(N, H)`` in row-major order of
    ``completion_mask``. Works for any model with a backbone (a critic's too)."""
    B = prompt_ids.shape[0]
    k = completion_ids.shape[0] // B
    rows = (torch.arange(B, device=prompt_ids.device).repeat(k) if prompt_index is None
            else prompt_index)  # (kB,) prompt of each row
    if replay is not None:
        packed = False
    elif packed is None:
        packed = packing_pays(model, prompt_mask, completion_mask, rows)
    target = completion_mask.bool()
    if packed:
        return _packed_hidden(model, prompt_ids, prompt_mask, completion_ids, target, rows)
    return _two_call_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                            rows, replay)[target]

PACKABLE_ATTENTION = ("sdpa", "eager")

# When the prompts cannot go into one packed call (the attention takes no 4-D mask, or the
# packed rows would be too long), sharing them costs a second forward call, which below this
# size costs more than the prompt tokens it saves. Per device type: the CPU figure comes
# from DPO on 2 cores (two-call shared against full sequences, docs/benchmarks.md); CUDA's
# is not measured yet and keeps the CPU figure. The trainers' automatic share_prompt reads it.
SHARE_PROMPT_MIN_PARAMS = {"cpu": 2_000_000, "cuda": 2_000_000}

def packs_shared_prompts(model: PreTrainedModel) -> bool:
    """Whether the model's attention takes the custom 4-D mask of the packed layout."""
    return getattr(model.config, "_attn_implementation", None) in PACKABLE_ATTENTION

# What the two-call path costs on top of the packed one, in tokens' worth of matmul work:
# every weight is used twice, so its gradient is two matmuls plus an add, and a second
# forward call is launched. Per device type: the CPU figure is measured on 2 cores for DPO
# pairs of ~14 tokens at 25M parameters (docs/benchmarks.md); CUDA's is not measured yet and
# keeps the CPU figure (a GPU's fixed cost per call is larger, so it is likely higher).
TWO_CALL_OVERHEAD_TOKENS = {"cpu": 128, "cuda": 128}


def packing_pays(model, prompt_mask, completion_mask, rows) -> bool:
    """Whether one packed call is cheaper than two calls: the attention implementation takes
    a custom 4-D mask, and the dense attention over the packed rows (≈ 4·L²·d·layers FLOPs
    per row, most of it on masked entries when a prompt has many completions) costs less
    than :data:`TWO_CALL_OVERHEAD_TOKENS` tokens of matmuls (2·N per token). DPO pairs pack;
    GRPO groups of 8 completions of 32 tokens (rows of ~260) take two calls."""
    cfg = model.config
    if not packs_shared_prompts(model):
        return False
    hidden = getattr(cfg, "hidden_size", None)
    layers = getattr(cfg, "num_hidden_layers", None)
    if not hidden or not layers:
        return False
    lengths = prompt_mask.sum(-1).long().index_add(0, rows, completion_mask.sum(-1).long())
    window = getattr(cfg, "sliding_window", None)
    if window and int(lengths.max()) > window:
        return False  # the custom mask would let tokens see past the window
    attention = 4 * float((lengths.double() ** 2).sum()) * hidden * layers
    overhead = for_device(TWO_CALL_OVERHEAD_TOKENS, prompt_mask.device)
    return attention <= 2 * active_parameters(model) * overhead

def _packed_hidden(model, prompt_ids, prompt_mask, completion_ids, target, rows):
    """Hidden states predicting each completion token ``(N, H)`` (N = ``target.sum()``, in
    row-major order of ``target``) from one call over rows ``[prompt, completion, ...]``."""
    dev = prompt_ids.device
    B, Lp = prompt_ids.shape
    p_len = prompt_mask.sum(-1).long()  # (B,)
    c_len = target.sum(-1).long()  # (R,)
    # start of each completion in its packed row: after the prompt and the earlier completions
    order = torch.argsort(rows, stable=True)
    sorted_len = c_len[order]
    first_of_prompt = torch.zeros(B + 1, dtype=torch.long, device=dev)
    first_of_prompt.index_add_(0, rows + 1, torch.ones_like(rows))
    first_of_prompt = first_of_prompt.cumsum(0)  # (B+1,) first sorted completion of each prompt
    csum = torch.cat([sorted_len.new_zeros(1), sorted_len.cumsum(0)])  # (R+1,)
    start_sorted = p_len[rows[order]] + csum[:-1] - csum[first_of_prompt[rows[order]]]
    start = torch.empty_like(start_sorted).scatter_(0, order, start_sorted)  # (R,)
    row_len = p_len.clone().index_add_(0, rows, c_len)
    L = int(row_len.max())
    ids = prompt_ids.new_zeros(B, L)
    pos = torch.zeros(B, L, dtype=torch.long, device=dev)
    seg = torch.full((B, L), -1, dtype=torch.long, device=dev)  # 0 prompt, r+1 completion r
    # prompts: left-padded column j holds token j - (Lp - p_len) of the packed row
    pb, pj = prompt_mask.bool().nonzero(as_tuple=True)
    pcol = pj - (Lp - p_len[pb])
    ids[pb, pcol] = prompt_ids[pb, pj]
    pos[pb, pcol] = pcol
    seg[pb, pcol] = 0
    # completions
    cr, ct = target.nonzero(as_tuple=True)  # row-major, the order of the result
    cb = rows[cr]
    ccol = start[cr] + ct
    ids[cb, ccol] = completion_ids[cr, ct]
    pos[cb, ccol] = p_len[cb] + ct
    seg[cb, ccol] = cr + 1
    # key k is visible from query q if k <= q and k is in the prompt (seen from a prompt or
    # completion token) or in q's own segment; padding sees padding, so no row is empty
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    visible = ((seg.unsqueeze(1) == seg.unsqueeze(2))
               | ((seg.unsqueeze(1) == 0) & (seg.unsqueeze(2) >= 0))) & causal  # (B, q, k)
    mask = visible.unsqueeze(1)  # (B, 1, L, L)
    dtype = model.get_input_embeddings().weight.dtype
    # the mask's form follows the implementation this call will run: a model whose
    # attention is picked per call (posttrain.fast.attention) is asked for this length first
    pick = getattr(model, "posttrain_attention_for_keys", None)
    impl = pick(L) if pick is not None else model.config._attn_implementation
    if impl == "eager":
        mask = torch.zeros(mask.shape, dtype=dtype, device=dev).masked_fill_(
            ~mask, torch.finfo(dtype).min)
    hidden = backbone(model)(input_ids=ids, attention_mask=mask, position_ids=pos,
                              use_cache=False).last_hidden_state  # (B, L, H)
    # token t of completion r is predicted at the slot before it: the prompt's last token
    # for t = 0, else the completion's own token t - 1
    src = torch.where(ct == 0, p_len[cb] - 1, ccol - 1)
    return hidden[cb, src]

def _two_call_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, rows,
                     replay=None):
    """Hidden states predicting each completion position ``(R, Lc, H)``: the prompts run
    once into a KV cache, which is repeated to each completion for a second call (its
    linear layers and MLPs replayed from ``replay`` when given)."""
    positions = (prompt_mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    kw = cache_kwarg(backbone(model))
    h_prompt = backbone(model)(input_ids=prompt_ids, attention_mask=prompt_mask,
                                position_ids=positions, use_cache=True,
                                **{kw: cache}).last_hidden_state[:, -1]  # (B, H)
    cache.batch_select_indices(rows)
    Lc = completion_ids.shape[1]
    c_positions = positions[rows, -1:] + 1 + torch.arange(Lc, device=positions.device)
    with replay if replay is not None else contextlib.nullcontext():
        h_comp = backbone(model)(
            input_ids=completion_ids,
            attention_mask=torch.cat([prompt_mask[rows], completion_mask], 1),
            position_ids=c_positions, use_cache=True, **{kw: cache}).last_hidden_state
    # h_comp: (kB, Lc, H)
    # token t of a completion is predicted from the hidden state before it
    return torch.cat([h_prompt[rows].unsqueeze(1), h_comp[:, :-1]], dim=1)



def decide_share_prompt(setting: bool | None, model: PreTrainedModel,
                        group_size: int | None = None) -> bool:
    """Whether a run shares its prompts, decided once at start-up: ``setting`` when given;
    automatically, on when a group's G > 1 completions share one prompt (G - 1 prompts'
    worth of every pass saved), when a pair packs into one call, or from
    :data:`SHARE_PROMPT_MIN_PARAMS` active parameters (the model's device type's entry).
    Never without output embeddings to apply at the completion positions."""
    if not has_plain_head(model):
        return False
    if setting is not None:
        return setting
    return bool((group_size is not None and group_size > 1)
                or (group_size is None and packs_shared_prompts(model))
                or active_parameters(model) >= for_device(
                    SHARE_PROMPT_MIN_PARAMS, next(model.parameters()).device))
