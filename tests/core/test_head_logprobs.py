"""head_token_logprobs (log-probs straight from hidden states, the head applied a chunk of
rows at a time in the forward and the backward) against a float64 reference written from
the formula, on random and extreme inputs, with every logit transform; and a check that no
(N, V) tensor is ever allocated."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.core.logprobs import head_token_logprobs

U = 2.0 ** -24  # float32 unit roundoff


def _reference(h, w, b, labels, scale, divide, softcap, temperature):
    """float64, from the formula: l = h Wᵀ + b; z = T(l); log softmax(z)[y]; entropy."""
    h, w = h.double(), w.double()
    logits = h @ w.T + (0 if b is None else b.double())
    logits = logits * scale / divide
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    z = logits / temperature
    zmax = z.max(-1, keepdim=True).values
    logp = z - zmax - torch.log(torch.exp(z - zmax).sum(-1, keepdim=True))
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _inputs(N=13, H=16, V=37, spread=1.0, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g) * spread
    w = torch.randn(V, H, generator=g) / math.sqrt(H)
    b = torch.randn(V, generator=g) if bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    return h, w, b, labels


TRANSFORMS = [dict(), dict(temperature=0.7), dict(softcap=5.0), dict(scale=0.5, divide=2.0),
              dict(softcap=30.0, temperature=1.3, scale=2.0)]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("chunk_rows", [1, 4, None])
@pytest.mark.parametrize("spread", [1.0, 30.0])  # 30: logits of ~±100, a peaked softmax
def test_values_and_gradients_match_the_float64_formula(transform, chunk_rows, spread):
    h, w, b, labels = _inputs(spread=spread)
    h.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True)
    lp, ent = head_token_logprobs(h, w, labels, b, with_entropy=True, chunk_rows=chunk_rows,
                                  **transform)
    upstream = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    (lp * upstream).sum().backward()
    grads = [x.grad.clone() for x in (h, w, b)]

    ref_args = [x.detach().double().requires_grad_(True) for x in (h, w, b)]
    ref_lp, ref_ent = _reference(*ref_args, labels, transform.get("scale", 1.0),
                                 transform.get("divide", 1.0), transform.get("softcap", 0.0),
                                 transform.get("temperature", 1.0))
    (ref_lp * upstream.double()).sum().backward()
    # float32 reductions of length H (the head) and V (the log-sum-exp), error growing like
    # √n·u per reduction, times the size of the logits they act on
    logit_size = float(ref_lp.detach().abs().max()) + spread * 10 + 1
    bound = 8 * (math.sqrt(16) + math.sqrt(37)) * U * logit_size
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp.double() - ref_lp.detach()).abs().max() <= bound
    assert (ent.double() - ref_ent.detach()).abs().max() <= bound
    for got, ref in zip(grads, ref_args, strict=True):
        want = ref.grad
        scale = float(want.abs().max()) + 1e-30
        assert float((got.double() - want).abs().max()) <= bound * max(scale, 1.0), got.shape


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("spread", [1.0, 30.0])
@pytest.mark.parametrize("off", [0.0, 0.05])
def test_with_the_samplers_statistics_the_values_shift_by_their_error_and_no_gradient_does(
        transform, spread, off):
    """``sampled``: the forward takes the known log-sum-exp (and entropy) instead of its own
    matmul, so a log-sum-exp off by ``off`` moves the log-probs by exactly that; the backward
    normalises the recomputed softmax itself, so the gradients stay the float64 formula's."""
    h, w, b, labels = _inputs(spread=spread)
    h.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True)
    targs = (transform.get("scale", 1.0), transform.get("divide", 1.0),
             transform.get("softcap", 0.0), transform.get("temperature", 1.0))
    ref_args = [x.detach().double().requires_grad_(True) for x in (h, w, b)]
    ref_lp, ref_ent = _reference(*ref_args, labels, *targs)
    # the sampler's log-sum-exp: log p(y) = z_y - lse
    with torch.no_grad():
        logits = ref_args[0] @ ref_args[1].T + ref_args[2]
        logits = logits * targs[0] / targs[1]
        if targs[2]:
            logits = targs[2] * torch.tanh(logits / targs[2])
        lse = torch.logsumexp(logits / targs[3], -1)
    sampled = torch.stack([lse + off, ref_ent.detach()]).float()
    lp, ent = head_token_logprobs(h, w, labels, b, with_entropy=True, known=sampled,
                                  **transform)
    upstream = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    (lp * upstream).sum().backward()
    (ref_lp * upstream.double()).sum().backward()
    logit_size = float(ref_lp.detach().abs().max()) + spread * 10 + 1
    bound = 8 * (math.sqrt(16) + math.sqrt(37)) * U * logit_size
    assert (lp.double() - (ref_lp.detach() - off)).abs().max() <= bound
    assert torch.equal(ent, sampled[1])
    for got, ref in zip((h.grad, w.grad, b.grad), ref_args, strict=True):
        scale = float(ref.grad.abs().max()) + 1e-30
        assert float((got.double() - ref.grad).abs().max()) <= bound * max(scale, 1.0)


def test_it_equals_the_unfused_path_without_bias_and_with_a_frozen_head():
    """No bias, a weight without gradient (a LoRA run's frozen head): only ∂/∂h flows."""
    from posttrain.core import token_logprobs

    h, w, _, labels = _inputs(bias=False)
    h1 = h.clone().requires_grad_(True)
    lp = head_token_logprobs(h1, w, labels)
    lp.sum().backward()
    h2 = h.clone().requires_grad_(True)
    ref = token_logprobs(h2 @ w.T, labels)
    ref.sum().backward()
    torch.testing.assert_close(lp, ref, rtol=0, atol=64 * U * 10)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=64 * U * 10)


def test_extreme_logits_stay_finite():
    h, w, b, labels = _inputs(spread=1e4)  # logits of ~±3e4
    h.requires_grad_(True)
    lp, ent = head_token_logprobs(h, w, labels, b, with_entropy=True, chunk_rows=3)
    lp.sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert torch.isfinite(h.grad).all() and (lp <= 0).all()


class _Largest(TorchDispatchMode):
    """The largest tensor any aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_full_vocabulary_tensor_is_allocated_forward_or_backward():
    N, H, V, rows = 64, 8, 4096, 8
    h, w, b, labels = _inputs(N=N, H=H, V=V)
    h.requires_grad_(True), w.requires_grad_(True)
    with _Largest() as seen:
        lp, _ = head_token_logprobs(h, w, labels, b, with_entropy=True, chunk_rows=rows)
        lp.sum().backward()
    assert seen.largest <= max(rows * V, V * H)  # a chunk's logits (or ∂W), never N × V
    assert seen.largest < N * V
    with _Largest() as naive:  # the check itself can fail: the unfused path trips it
        (h @ w.T).log_softmax(-1)
    assert naive.largest >= N * V
