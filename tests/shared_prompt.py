"""One check for the CPU and GPU tests: the shared-prompt forward against full sequences."""

from __future__ import annotations

import torch

from posttrain.data import pad_sequences, pad_shared_prompts
from posttrain.models import completion_logprobs, shared_prompt_logprobs

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]  # left padding matters: different lengths
COMPLETIONS = [[20, 21], [22], [23, 24, 25], [30], [31, 32, 33], [34, 35]]  # k = 2 each


def assert_shared_prompt_equals_full(model, packed: bool | None, tol: float = 1e-5,
                                     grad_rtol: float = 1e-4, grad_atol: float = 1e-5) -> None:
    """Each prompt run once for its two completions gives the per-sequence log-likelihoods
    and parameter gradients of the concatenated full sequences, on the model's device."""
    device = next(model.parameters()).device
    shared = {k: v.to(device) for k, v in pad_shared_prompts(PROMPTS, COMPLETIONS, 0).items()}
    full = {k: v.to(device) for k, v in pad_sequences(PROMPTS * 2, COMPLETIONS, 0).items()}

    def run(fn):
        model.zero_grad()
        seq = fn().sum(-1)
        seq.sum().backward()
        return seq.detach(), [p.grad.clone() for p in model.parameters()]

    a, grads_a = run(lambda: shared_prompt_logprobs(
        model, shared["prompt_ids"], shared["prompt_mask"], shared["completion_ids"],
        shared["completion_mask"], packed=packed))
    b, grads_b = run(lambda: completion_logprobs(
        model, full["input_ids"], full["attention_mask"], full["loss_mask"]))
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, rtol=grad_rtol, atol=grad_atol)
