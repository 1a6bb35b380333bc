"""head_token_logprobs (log-probs straight from hidden states, the head applied a chunk of
rows at a time in the forward and the backward) against a float64 reference written from
the formula, on random and extreme inputs, with every logit transform; and a check that no
(N, V) tensor is ever allocated."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bounds import assert_within, entropy_error, logsoftmax_error, unit_roundoff
from posttrain.core.logprobs import head_token_logprobs


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


def _bounds(h, w, b, labels, upstream, transform=None, known=False, dtype=torch.float32):
    """Element by element, the error of the head's log-probs, entropies and gradients (h, W, b)
    computed in ``dtype`` (first order; magnitudes from the float64 formula). Logits: a dot of
    length H plus the bias, ``H·u·A`` with ``A = |h||W|ᵀ + |b|`` the terms' size; the
    transforms (× scale, ÷ divide, ÷ c, tanh within an ulp, × c, ÷ T) round 7 times on values
    ≤ A·s (s = scale/divide; the softcap only shrinks them) and scale the error by s/T:
    ``e_z = (H + 7)·u·A·s/T``. Log-prob: z_y − lse moves by ≤ 2·max e_z over the row, plus
    the log-softmax's own rounding (bounds.logsoftmax_error, L); entropy: Σ p|log p + H| ≤
    2 log V times e_z, plus bounds.entropy_error. Backward: p = exp(z − lse) relative
    2·e_z + 2L + 2u (+ (V + 1)·u renormalised with ``known``); ∂ℓ/∂z = g·(1[v=y] − p) that
    times p plus 2u of it; × (1 − tanh²) (its error 2·e_z·T/c + 3u) × s/T (3u); then the
    matmuls of length V (∂h), N (∂W over the chunks) and N (∂b): the propagated errors
    through |W| or |h| and the reductions' length·u of the terms."""
    t = {"scale": 1.0, "divide": 1.0, "softcap": 0.0, "temperature": 1.0, **(transform or {})}
    u = unit_roundoff(dtype)
    N, H = h.shape
    V = w.shape[0]
    h64, w64 = h.detach().double(), w.detach().double()
    b64 = torch.zeros(V, dtype=torch.float64) if b is None else b.detach().double()
    s, T, c = t["scale"] / t["divide"], t["temperature"], t["softcap"]
    A = h64.abs() @ w64.abs().T + b64.abs()
    l = (h64 @ w64.T + b64) * s
    z = (c * torch.tanh(l / c) if c else l) / T
    e_z = ((H + 7) * u * A * s / T).amax(-1)  # per row
    L = logsoftmax_error(z, dtype)
    lp = 2 * e_z + L
    ent = 2 * math.log(V) * e_z + entropy_error(z, dtype)
    p = z.softmax(-1)
    onehot = torch.nn.functional.one_hot(labels, V).double()
    up = upstream.detach().double().abs()[:, None]
    rel_p = (2 * e_z + 2 * L + 2 * u)[:, None] + ((V + 1) * u if known else 0.0)
    g_z = up * (onehot - p).abs()
    e_gz = up * p * rel_p + 2 * u * g_z
    cap = 1 - torch.tanh(l / c).square() if c else torch.ones_like(z)
    e_cap = (2 * e_z * T / c + 3 * u)[:, None] if c else torch.zeros(N, 1, dtype=torch.float64)
    g_l = g_z * cap * s / T
    e_gl = (e_gz * cap + g_z * (e_cap + 3 * u)) * s / T
    e_h = e_gl @ w64.abs() + V * u * (g_l @ w64.abs())
    e_w = e_gl.T @ h64.abs() + N * u * (g_l.T @ h64.abs())
    e_b = e_gl.sum(0) + N * u * g_l.sum(0)
    return lp, ent, [e_h, e_w, e_b]


def _vs_ref(*args, **kwargs):
    """The float32 path against the float64 formula: the sum of both computations' bounds."""
    (lp, ent, grads), (lp64, ent64, grads64) = (_bounds(*args, **kwargs),
                                                _bounds(*args, **kwargs, dtype=torch.float64))
    return lp + lp64, ent + ent64, [g + g64 for g, g64 in zip(grads, grads64, strict=True)]


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
    # element by element within the derived bounds (_bounds, float32 + float64): at most
    # ~1e-3 of log-probs of O(1-100) nats and gradients of O(1-10); a wrong row, label or
    # chunk is O(1) off
    b_lp, b_ent, b_grads = _vs_ref(h, w, b, labels, upstream, transform)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert_within(lp, ref_lp.detach(), 1.0, b_lp, "log-probs")
    assert_within(ent, ref_ent.detach(), 1.0, b_ent, "entropies")
    for got, ref, bound, name in zip(grads, ref_args, b_grads, "hWb", strict=True):
        assert_within(got, ref.grad, 1.0, bound, f"grad {name}")


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
    # the derived bounds (_bounds): the label's logit rounds as in the full forward, and the
    # given lse once more to float32 (within L); the backward renormalises (known=True)
    b_lp, _, b_grads = _vs_ref(h, w, b, labels, upstream, transform, known=True)
    assert_within(lp, ref_lp.detach() - off, 1.0, b_lp, "log-probs")
    assert torch.equal(ent, sampled[1])
    for got, ref, bound, name in zip((h.grad, w.grad, b.grad), ref_args, b_grads, "hWb",
                                     strict=True):
        assert_within(got, ref.grad, 1.0, bound, f"grad {name}")


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
    # two float32 paths, each within the derived bound (_bounds): twice it
    b_lp, _, (b_h, _, _) = _bounds(h, w, None, labels, torch.ones(len(labels)))
    assert_within(lp, ref, 2.0, b_lp, "log-probs")
    assert_within(h1.grad, h2.grad, 2.0, b_h, "grad h")


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
