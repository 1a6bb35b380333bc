"""One check for the CPU and GPU tests: the shared-prompt forward against full sequences."""

from __future__ import annotations

import torch

from bounds import (
    assert_within,
    grad_term_scales,
    logprob_scale,
    model_inner,
    model_stages,
    pair_bound,
)
from posttrain.data import pad_sequences, pad_shared_prompts
from posttrain.models import completion_logprobs, shared_prompt_logprobs

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]  # left padding matters: different lengths
COMPLETIONS = [[20, 21], [22], [23, 24, 25], [30], [31, 32, 33], [34, 35]]  # k = 2 each


def assert_shared_prompt_equals_full(model, packed: bool | None, tol: float | None = None,
                                     grad_rtol: float | None = None,
                                     grad_atol: float | None = None) -> None:
    """Each prompt run once for its two completions gives the per-sequence log-likelihoods
    and parameter gradients of the concatenated full sequences, on the model's device.

    Without ``tol``/``grad_*`` the bounds are derived (tests/bounds.py): the two layouts are
    two float32 forwards (and backwards) of the model plus the log-softmax over V and the
    sum over a completion's tokens, reductions no longer than V, the widths or the batch's
    tokens (each weight's gradient sums over all of them). A sequence's terms are its
    tokens' log-probs, a gradient's the per-token gradients. (A gradient 1% off or without
    one token's term is far outside: the bound is ~1e-4 of the terms.)"""
    device = next(model.parameters()).device
    shared = {k: v.to(device) for k, v in pad_shared_prompts(PROMPTS, COMPLETIONS, 0).items()}
    full = {k: v.to(device) for k, v in pad_sequences(PROMPTS * 2, COMPLETIONS, 0).items()}
    params = list(model.parameters())
    scales = []

    def run(fn, terms=False):
        model.zero_grad()
        lp = fn()
        if terms:
            scales.extend(grad_term_scales(lp[lp != 0], params))
        seq = lp.sum(-1)
        seq.sum().backward()
        return seq.detach(), [p.grad.clone() for p in params]

    a, grads_a = run(lambda: shared_prompt_logprobs(
        model, shared["prompt_ids"], shared["prompt_mask"], shared["completion_ids"],
        shared["completion_mask"], packed=packed))
    b, grads_b = run(lambda: completion_logprobs(
        model, full["input_ids"], full["attention_mask"], full["loss_mask"]), terms=True)
    if tol is not None:  # the GPU test's own tolerances
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        for ga, gb in zip(grads_a, grads_b, strict=True):
            torch.testing.assert_close(ga, gb, rtol=grad_rtol, atol=grad_atol)
        return
    cfg, tokens = model.config, full["input_ids"].numel()
    with torch.no_grad():
        lp_scale = logprob_scale(model(input_ids=full["input_ids"],
                                       attention_mask=full["attention_mask"]).logits)
    longest = max(map(len, COMPLETIONS))
    assert_within(a, b, pair_bound(model_stages(cfg, False) + 2, model_inner(cfg, tokens)),
                  longest * lp_scale, "sequence log-likelihoods")
    bound = pair_bound(model_stages(cfg) + 2, model_inner(cfg, tokens))
    for (name, _), ga, gb, s in zip(model.named_parameters(), grads_a, grads_b, scales,
                                    strict=True):
        assert_within(ga, gb, bound, s, name)
