"""token_logprobs / token_entropy against float64 log-softmax references and the naive path."""

from __future__ import annotations

import math

import pytest
import torch

from bounds import entropy_error, logsoftmax_error, logsoftmax_grad_error, unit_roundoff
from posttrain.core.logprobs import token_entropy, token_logprobs

SHAPES = [(1, 1, 3), (2, 5, 7), (3, 4, 11)]
CHUNKS = [None, 1, 3]  # 3 divides neither T = 4 nor T = 5


def _vs_ref(logits, error=logsoftmax_error) -> float:
    """The function (float32, or float64 for float64 logits) against the float64 reference:
    the sum of both computations' derived errors on these logits (tests/bounds.py). A wrong
    label, row or chunk is off by O(1) nats, ~10^4 times any of these bounds."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return error(logits, dtype) + error(logits, torch.float64)


def _inputs(shape, seed, scale=3.0, dtype=torch.float32, p_ignore=0.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    if p_ignore:
        labels[torch.rand(shape[:-1], generator=g) < p_ignore] = -100
    return logits, labels


def _ref_log_softmax(logits):
    """log-softmax in float64, subtracting the row maximum by hand."""
    x = logits.double()
    shifted = x - x.amax(-1, keepdim=True)
    return shifted - shifted.exp().sum(-1, keepdim=True).log()


def _ref_logprobs(logits, labels):
    """float64 log p(label), 0 where the label is negative."""
    lp = _ref_log_softmax(logits).gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    return torch.where(labels < 0, torch.zeros_like(lp), lp)


def _ref_entropy(logits):
    """-Σ_v p_v log p_v per row, as a Python loop over float64 log-probabilities."""
    logp = _ref_log_softmax(logits)
    rows = logp.reshape(-1, logp.shape[-1]).tolist()
    ent = [-sum(math.exp(lv) * lv for lv in row) for row in rows]
    return torch.tensor(ent, dtype=torch.float64).view(logp.shape[:-1])


def _naive_logprobs(logits, labels):
    """The documented naive path, differentiable: log_softmax(-1).gather(...)."""
    lp = logits.log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    return torch.where(labels < 0, torch.zeros_like(lp), lp)


def _naive_entropy(logits):
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_rows", CHUNKS)
def test_logprobs_float32(shape, chunk_rows):
    """float32: within the derived bound of the float64 reference and of
    log_softmax().gather() (two float32 log-softmaxes: twice the one's bound)."""
    logits, labels = _inputs(shape, sum(shape))
    got = token_logprobs(logits, labels, chunk_rows=chunk_rows)
    assert got.shape == shape[:-1] and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _ref_logprobs(logits, labels), rtol=0,
                               atol=_vs_ref(logits))
    torch.testing.assert_close(got, _naive_logprobs(logits, labels), rtol=0,
                               atol=2 * logsoftmax_error(logits))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_rows", CHUNKS)
def test_logprobs_float64(shape, chunk_rows):
    """float64 logits give float64 log-probabilities, exact to float64 rounding."""
    logits, labels = _inputs(shape, 7 + sum(shape), dtype=torch.float64)
    got = token_logprobs(logits, labels, chunk_rows=chunk_rows)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _ref_logprobs(logits, labels), rtol=0, atol=_vs_ref(logits))


@pytest.mark.parametrize("chunk_rows", CHUNKS)
def test_logprobs_non_contiguous(chunk_rows):
    """logits[:, :-1] with labels[:, 1:] (the causal-LM shift) equals the contiguous copy."""
    logits, labels = _inputs((3, 6, 9), 5)
    view, lab = logits[:, :-1], labels[:, 1:]
    assert not view.is_contiguous()
    got = token_logprobs(view, lab, chunk_rows=chunk_rows)
    torch.testing.assert_close(got.double(), _ref_logprobs(view.contiguous(), lab),
                               rtol=0, atol=_vs_ref(view))
    torch.testing.assert_close(got, token_logprobs(view.contiguous(), lab.contiguous(),
                                                   chunk_rows=chunk_rows), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_logprobs_half_precision(dtype, chunk_rows):
    """Half-precision logits give float32 output, as exact as float32 on the rounded inputs."""
    logits, labels = _inputs((2, 5, 13), 3, dtype=dtype)
    got = token_logprobs(logits, labels, chunk_rows=chunk_rows)
    assert got.dtype == torch.float32
    # The reference starts from the very half-precision values the function saw, which it
    # computes on in float32: the float32 bound.
    torch.testing.assert_close(got.double(), _ref_logprobs(logits, labels), rtol=0,
                               atol=_vs_ref(logits))


def test_logprobs_negative_labels_give_zero():
    """Labels -100 (and any negative label) give exactly 0; the others are unaffected."""
    logits, labels = _inputs((3, 8, 6), 11, p_ignore=0.4)
    labels[0, 0] = -1
    ignored = labels < 0
    assert ignored.any() and (~ignored).any()
    got = token_logprobs(logits, labels, chunk_rows=3)
    assert torch.equal(got[ignored], torch.zeros(int(ignored.sum())))
    torch.testing.assert_close(got.double(), _ref_logprobs(logits, labels), rtol=0,
                               atol=_vs_ref(logits))
    assert (got[~ignored] < 0).all()


@pytest.mark.parametrize("chunk_rows", [None, 1, 4])
def test_logprobs_2d_input(chunk_rows):
    """(N, V) logits with (N,) labels give (N,) log-probabilities."""
    logits, labels = _inputs((9, 5), 2)
    labels[3] = -100
    got = token_logprobs(logits, labels, chunk_rows=chunk_rows)
    assert got.shape == (9,)
    torch.testing.assert_close(got.double(), _ref_logprobs(logits, labels), rtol=0,
                               atol=_vs_ref(logits))


def test_logprobs_default_chunking_over_many_chunks():
    """A vocabulary large enough that the default chunk size splits T unevenly."""
    logits, labels = _inputs((1, 70, 32768), 13)
    got = token_logprobs(logits, labels)
    torch.testing.assert_close(got.double(), _ref_logprobs(logits, labels), rtol=0,
                               atol=_vs_ref(logits))
    ent = token_entropy(logits)
    # the naive entropy in float64 as the reference: the float64 bound of this computation
    torch.testing.assert_close(ent.double(), _naive_entropy(logits.double()), rtol=0,
                               atol=_vs_ref(logits, entropy_error))


def test_logprobs_shape_mismatch_raises():
    """Labels whose shape is not logits.shape[:2] are rejected."""
    logits, labels = _inputs((2, 5, 7), 0)
    with pytest.raises(ValueError):
        token_logprobs(logits, labels[:, :-1])


def _extreme_logits(dtype):
    """Logits of magnitude ~1e4: random rows, a uniform row and a one-hot-like row."""
    g = torch.Generator().manual_seed(17)
    x = torch.randn(2, 6, 10, generator=g, dtype=torch.float64) * 1e4
    x[0, 0] = 1e4                         # uniform: log p = -log V, H = log V
    x[0, 1] = -1e4
    x[0, 1, 4] = 1e4                      # one token 2e4 above the rest: p ≈ 1, H ≈ 0
    x[1, 2] = torch.linspace(-1e4, 1e4, 10, dtype=torch.float64)
    labels = torch.randint(0, 10, (2, 6), generator=g)
    labels[0, 1] = 4
    return x.to(dtype), labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_logprobs_extreme_logits(dtype, chunk_rows):
    """Logits ±1e4: finite, and within the derived bound of the reference (a few ulp of the
    largest logit: logsoftmax_error is 4u times twice it, plus √V·u)."""
    logits, labels = _extreme_logits(dtype)
    got = token_logprobs(logits, labels, chunk_rows=chunk_rows)
    assert torch.isfinite(got).all()
    atol = _vs_ref(logits)
    torch.testing.assert_close(got.double(), _ref_logprobs(logits, labels), rtol=0, atol=atol)
    assert float(got[0, 0]) == pytest.approx(-math.log(10), abs=atol)
    assert float(got[0, 1]) == pytest.approx(0.0, abs=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_entropy_extreme_logits(dtype, chunk_rows):
    """Logits ±1e4: finite entropy within the derived bound of the reference (linear in the
    largest logit, not quadratic as for lse − Σ p·z)."""
    logits, _ = _extreme_logits(dtype)
    got = token_entropy(logits, chunk_rows=chunk_rows)
    assert torch.isfinite(got).all()
    atol = _vs_ref(logits, entropy_error)
    torch.testing.assert_close(got.double(), _ref_entropy(logits), rtol=0, atol=atol)
    assert float(got[0, 0]) == pytest.approx(math.log(10), abs=atol)
    assert float(got[0, 1]) == pytest.approx(0.0, abs=atol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_rows", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entropy_values(shape, chunk_rows, dtype):
    """Entropy equals the loop -Σ p log p of the float64 reference."""
    logits, _ = _inputs(shape, 31 + sum(shape), dtype=dtype)
    got = token_entropy(logits, chunk_rows=chunk_rows)
    assert got.shape == shape[:-1] and got.dtype == dtype
    atol = _vs_ref(logits, entropy_error)
    torch.testing.assert_close(got.double(), _ref_entropy(logits), rtol=0, atol=atol)
    assert (got >= -atol).all() and (got <= math.log(shape[-1]) + atol).all()


@pytest.mark.parametrize("shift", [-300.0, 300.0])
def test_entropy_is_shift_invariant(shift):
    """Adding a constant to every logit leaves the entropy unchanged, to float32 rounding of
    the shifted logits (an error that does not grow with the square of the shift)."""
    logits, _ = _inputs((2, 6, 50), 21)
    shifted = logits + shift
    got = token_entropy(shifted, chunk_rows=5)
    torch.testing.assert_close(got.double(), _ref_entropy(shifted), rtol=0,
                               atol=_vs_ref(shifted, entropy_error))
    # the shift rounds each logit by ≤ u·max|shifted|, which moves H by at most that times
    # Σ_v |∂H/∂z_v| = Σ p_v·|log p_v + H| ≤ 2H ≤ 2 log V; each entropy within its own bound
    # (linear in the shift: lse − Σ p·z would be off by ~u·shift², 1e-2 nats here)
    moved = unit_roundoff() * float(shifted.abs().max()) * 2 * math.log(logits.shape[-1])
    atol = entropy_error(shifted) + entropy_error(logits) + moved
    torch.testing.assert_close(got, token_entropy(logits), rtol=0, atol=atol)


def test_entropy_non_contiguous_2d_and_half():
    """Entropy on logits[:, :-1], on (N, V) input and on bf16 input (float32 out)."""
    logits, _ = _inputs((3, 6, 9), 8)
    view = logits[:, :-1]
    torch.testing.assert_close(token_entropy(view, chunk_rows=4).double(),
                               _ref_entropy(view), rtol=0, atol=_vs_ref(view, entropy_error))
    flat = logits[0]
    got2d = token_entropy(flat, chunk_rows=4)
    assert got2d.shape == (6,)
    torch.testing.assert_close(got2d.double(), _ref_entropy(flat), rtol=0,
                               atol=_vs_ref(flat, entropy_error))
    bf = logits.bfloat16()
    got_bf = token_entropy(bf)
    assert got_bf.dtype == torch.float32
    # computed in float32 on the bf16 values the reference also starts from
    torch.testing.assert_close(got_bf.double(), _ref_entropy(bf), rtol=0,
                               atol=_vs_ref(bf, entropy_error))


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_rows", CHUNKS)
def test_logprobs_gradient_matches_naive(shape, chunk_rows):
    """The gradient w.r.t. the logits equals the naive path's, ignored labels included."""
    logits, labels = _inputs(shape, 40 + sum(shape), dtype=torch.float64, p_ignore=0.3)
    w = torch.randn(shape[:-1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    (token_logprobs(a, labels, chunk_rows=chunk_rows) * w).sum().backward()
    (_naive_logprobs(b, labels) * w).sum().backward()
    # two float64 paths: twice the derived bound, times the weight on each position's gradient
    atol = 2 * logsoftmax_grad_error(logits, torch.float64) * float(w.abs().max())
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=atol)
    ignored = labels < 0
    assert torch.equal(a.grad[ignored], torch.zeros_like(a.grad[ignored]))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_rows", CHUNKS)
def test_entropy_gradient_matches_naive(shape, chunk_rows):
    """The entropy gradient equals autograd through -(softmax · log_softmax).sum."""
    logits, _ = _inputs(shape, 60 + sum(shape), dtype=torch.float64)
    w = torch.randn(shape[:-1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    (token_entropy(a, chunk_rows=chunk_rows) * w).sum().backward()
    (_naive_entropy(b) * w).sum().backward()
    atol = 2 * logsoftmax_grad_error(logits, torch.float64) * float(w.abs().max())
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=atol)


def test_gradients_float32_non_contiguous():
    """float32 gradients through a shifted (non-contiguous) view equal the naive path's."""
    logits, labels = _inputs((2, 7, 8), 9)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    (token_logprobs(a[:, :-1], labels[:, 1:], chunk_rows=3).sum()
     + token_entropy(a[:, :-1], chunk_rows=3).sum()).backward()
    (_naive_logprobs(b[:, :-1], labels[:, 1:]).sum() + _naive_entropy(b[:, :-1]).sum()).backward()
    # two float32 paths, each within logsoftmax_grad_error of exact (elements are O(1): a
    # 1% error in p is far beyond the bound)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=2 * logsoftmax_grad_error(logits))
    assert torch.equal(a.grad[:, -1], torch.zeros_like(a.grad[:, -1]))


def test_gradients_bf16():
    """bf16 logits get a bf16 gradient equal (to bf16 rounding) to the float32 naive one."""
    logits, labels = _inputs((2, 5, 13), 3, dtype=torch.bfloat16)
    a = logits.clone().requires_grad_(True)
    (token_logprobs(a, labels).sum() + token_entropy(a).sum()).backward()
    assert a.grad.dtype == torch.bfloat16
    b = logits.float().requires_grad_(True)
    (_naive_logprobs(b, labels).sum() + _naive_entropy(b).sum()).backward()
    # Each of the two gradients is computed in float32 and rounded to bf16 (u_bf16 of itself),
    # and autograd adds them in bf16 (u_bf16 of the sum): u_bf16·(2|g_lp| + 2|g_H|) element by
    # element, plus the two float32 computations' bound. A 1% error is not always beyond this
    # (bf16 keeps 8 bits); an error of the terms' size (a wrong p, a lost term) is.
    parts = []
    for f in (lambda x: _naive_logprobs(x, labels).sum(), lambda x: _naive_entropy(x).sum()):
        c = logits.float().requires_grad_(True)
        f(c).backward()
        parts.append(c.grad.abs())
    limit = (unit_roundoff(torch.bfloat16) * 2 * (parts[0] + parts[1])
             + 2 * logsoftmax_grad_error(logits))
    assert ((a.grad.float() - b.grad).abs() <= limit).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_extreme_logits(dtype):
    """Logits ±1e4: finite gradients, equal to the float64 naive path's (1[v=y] - p, etc.)."""
    logits, labels = _extreme_logits(dtype)
    a = logits.clone().requires_grad_(True)
    (token_logprobs(a, labels, chunk_rows=4).sum() + token_entropy(a, chunk_rows=4).sum()
     ).backward()
    assert torch.isfinite(a.grad).all()
    b = logits.double().requires_grad_(True)
    (_naive_logprobs(b, labels).sum() + _naive_entropy(b).sum()).backward()
    # Linear in the largest logit (the lse rounds at 1e4, ulp ~1e-3 in float32), so ~1e-2
    # here; wrong or missing terms are off by O(1) (p ≈ 1 or 0 on these rows).
    atol = logsoftmax_grad_error(logits, dtype) + logsoftmax_grad_error(logits, torch.float64)
    torch.testing.assert_close(a.grad.double(), b.grad, rtol=0, atol=atol)
