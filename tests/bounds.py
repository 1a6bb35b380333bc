"""Float error bounds for tests, derived from the arithmetic rather than measured.

A float sum or dot product of length ``n`` rounds at each of its additions; when those
rounding errors are independent they grow like ``√n·u`` in relative terms (Higham,
*Accuracy and Stability of Numerical Algorithms*, §2.8 and §3.1), where ``u`` is the unit
roundoff (``2**-24`` for float32). A network forward and backward is a chain of such
reductions whose errors add up, so a computation of ``stages`` dependent reductions of
length at most ``inner`` stays within ``stages·√inner·u`` of exact arithmetic. Two float32
computations of the same quantity by different kernels (another summation order, another
vector width) each meet that bound, so they differ by at most twice it.
"""

from __future__ import annotations

import math

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


def rel_bound(stages: int, inner: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative error-norm bound of ``stages`` dependent reductions of length ≤ ``inner``."""
    return stages * math.sqrt(inner) * unit_roundoff(dtype)


def model_stages(config, backward: bool = True) -> int:
    """Dependent reductions in a decoder forward (and backward): per layer q/k/v, scores,
    attention·V, o, softmax and norm sums, gate/up, down (≈ 8), plus the final norm and the
    head; the backward runs the chain once more for the input gradients and once for the
    weight gradients."""
    forward = 8 * config.num_hidden_layers + 2
    return forward * (3 if backward else 1)


def model_inner(config, length: int) -> int:
    """The longest reduction in a decoder pass over ``length`` positions."""
    return max(config.hidden_size, config.intermediate_size, config.vocab_size, length)


# Two float32 paths compared element by element.
#
# ``rel_bound`` bounds an error *norm* relative to the result's norm; it does not bound an
# element relative to itself. A dot product's error is relative to the sum of the absolute
# values of its terms (Higham §3.1: |fl(xᵀy) − xᵀy| ≤ γ_n·|x|ᵀ|y|), which can be far larger
# than the result when the terms cancel, and the error a stage passes on (a rounded
# activation, a rounded back-propagated vector) is relative to that vector's size, not to
# each of its elements. So an element near zero still carries an absolute error of the size
# of the terms of its tensor: the elementwise bound is ``pair_bound · scale`` with ``scale``
# the magnitude of the terms summed into the tensor (``logprob_scale``, ``grad_term_scales``),
# never the element's own value.


def pair_bound(stages: int, inner: int, dtype: torch.dtype = torch.float32) -> float:
    """Two computations of the same quantity, each within ``rel_bound`` of exact arithmetic,
    differ by at most twice it."""
    return 2 * rel_bound(stages, inner, dtype)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: float, scale, what: str = ""):
    """``|got − want| ≤ bound · scale`` element by element; ``scale`` (a float, or a tensor
    that broadcasts to ``got``) is the magnitude of the terms summed into each element."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    limit = bound * torch.as_tensor(scale, dtype=torch.float64)
    diff = (got.double() - want.double()).abs()
    over = diff > limit
    if over.any():
        i = int((diff - limit).flatten().argmax())
        raise AssertionError(
            f"{what}: {int(over.sum())} / {diff.numel()} elements beyond the derived bound; "
            f"worst |diff| {float(diff.flatten()[i]):.3g} > "
            f"{float(limit.broadcast_to(diff.shape).flatten()[i]):.3g} "
            f"(bound {bound:.3g} × scale)")


def logprob_scale(logits: torch.Tensor) -> float:
    """The terms of a log-softmax entry ``z_y − logsumexp(z)`` over the given logits: each is
    at most ``max|z| + log V`` (the log-sum-exp lies in ``[max z, max z + log V]``)."""
    return 2 * float(logits.detach().abs().amax()) + math.log(logits.shape[-1])


def grad_term_scales(terms: torch.Tensor, params) -> list[float]:
    """Per parameter, the magnitude of the terms its gradient of ``terms.sum()`` adds up:
    the largest element of ``Σ_k |∂ terms_k / ∂p|`` (one backward per term; the graph is
    kept). Its maximum over the tensor, because an upstream error reaches every element of a
    weight's gradient (see above). A gradient with a bug of one term's size differs from the
    right one by ``max|∂ terms_k/∂p|``, which is far above ``pair_bound`` times this for any
    batch of fewer than ``1 / pair_bound`` terms."""
    params = list(params)
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    flat = terms.flatten()
    for k in range(flat.numel()):
        grads = torch.autograd.grad(flat[k], params, retain_graph=True, allow_unused=True)
        for t, g in zip(total, grads, strict=True):
            if g is not None:
                t += g.double().abs()
    return [float(t.amax()) if t.numel() else 0.0 for t in total]


def grad_term_scales_by_row(rows, params) -> list[float]:
    """``grad_term_scales`` of the terms of ``rows``, a sequence of 1-d tensors each from its
    own graph (one sequence's forward, say): the same ``Σ_k |∂ terms_k / ∂p|``, but a term's
    backward runs through its own row's graph only, and a row's terms go through one
    vectorised backward (``is_grads_batched``, the rows of an identity as the seeds). The
    graph must be free of in-place ops on vmapped tensors (a plain ``log_softmax`` head)."""
    params = list(params)
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for terms in rows:
        if terms.numel() == 0:
            continue
        seeds = torch.eye(terms.numel(), dtype=terms.dtype)
        grads = torch.autograd.grad(terms, params, grad_outputs=seeds, is_grads_batched=True,
                                    allow_unused=True)
        for t, g in zip(total, grads, strict=True):
            if g is not None:
                t += g.double().abs().sum(0)
    return [float(t.amax()) if t.numel() else 0.0 for t in total]


def logprob_tolerance(model, logits: torch.Tensor, extra: int = 1) -> float:
    """Two float32 computations of log-probs from ``model``'s logits (a sampler's incremental
    forward and a full one, say): ``pair_bound`` of the model's forward plus ``extra``
    reductions over V (the log-softmax; a renormalisation adds one more), times the terms'
    size on these ``logits`` (``logprob_scale``, already divided by any temperature)."""
    cfg = model.config
    return pair_bound(model_stages(cfg, backward=False) + extra,
                      model_inner(cfg, logits.shape[-1])) * logprob_scale(logits)


# One log-softmax (``token_logprobs``, ``token_entropy``) against exact arithmetic, entry by
# entry. Sharper than ``rel_bound`` with ``logprob_scale``: the one reduction, the sum of V
# exponentials, adds positive terms, so its error is relative to the sum and the log turns it
# into an absolute one that does not grow with the logits.


def logsoftmax_error(logits: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """``z_y − logsumexp(z)`` (and the log-sum-exp) computed in ``dtype``: the sum of V
    positive exponentials is within ``√V·u`` relative, the exp's rounding ``u`` relative, both
    absolute after the log; the shift by the max (through the exp), the log, adding the max
    back and the final subtraction each round once, on operands at most ``logprob_scale``."""
    u = unit_roundoff(dtype)
    return u * (math.sqrt(logits.shape[-1]) + 1 + 4 * logprob_scale(logits))


def entropy_error(logits: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """``H = −Σ_v p_v log p_v`` with ``log p = z − lse`` (each off by ``L``, logsoftmax_error)
    and ``p = exp(log p)`` (relative error ``L + u``): ``Σ p_v·L + Σ p_v|log p_v|·(L + 2u)`` and
    the sum of V positive terms adding up to ``H ≤ log V`` (``√V·u·H``)."""
    u, log_v = unit_roundoff(dtype), math.log(logits.shape[-1])
    big_l = logsoftmax_error(logits, dtype)
    return big_l * (1 + log_v) + u * (math.sqrt(logits.shape[-1]) + 2) * log_v


def logsoftmax_grad_error(logits: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """The gradient of a log-prob (``1[v=y] − p_v``) plus that of the entropy
    (``−p_v·(log p_v + H)``) with respect to the logits, element by element: ``p_v ≤ 1`` off by
    ``L + u`` relative, times the factors ``1`` and ``|log p_v| + H`` (``p·|log p| ≤ 1/e``,
    ``H ≤ log V``); the factor ``log p_v + H`` off by ``L`` plus the entropy's error; a
    rounding of ``u`` at each of the three products and the two sums."""
    u, log_v = unit_roundoff(dtype), math.log(logits.shape[-1])
    big_l = logsoftmax_error(logits, dtype)
    return ((big_l + u) * (2 + log_v) + big_l + entropy_error(logits, dtype)
            + 5 * u * (2 + log_v))



# Statistics of a handful of values (a group's rewards, a batch's kept entries), element by
# element and in any summation order: a sum of n terms in any order (any tree) is within
# (n − 1)·u of the sum of their absolute values (Higham §4.2, the worst case, not √n: the
# sizes here are small and a bound must hold on every kernel).


def moment_errors(x: torch.Tensor, dtype: torch.dtype = torch.float32):
    """For ``x`` (float64, the n values exactly as ``dtype`` holds them), first-order error
    bounds of the statistics computed in ``dtype``: ``mean = Σx/n`` (the sum's (n−1)·u·Σ|x|,
    over n, and the division's u·|mean|), each centred ``c_i = x_i − mean`` (the mean's error
    and the subtraction's u·|c_i|), and ``Σ c_i²`` (each square 2|c_i|·e_c_i + u·c_i², the
    sum's (n−1)·u·Σc²). Returns ``(mean, c, e_mean, e_c, sumsq, e_sumsq)``."""
    u, n = unit_roundoff(dtype), x.numel()
    mean = x.sum() / n
    c = x - mean
    e_mean = u * ((n - 1) * x.abs().sum() / n + mean.abs())
    e_c = e_mean + u * c.abs()
    sumsq = c.square().sum()
    e_sumsq = (2 * c.abs() * e_c + u * c.square()).sum() + (n - 1) * u * sumsq
    return float(mean), c, float(e_mean), e_c, float(sumsq), float(e_sumsq)
