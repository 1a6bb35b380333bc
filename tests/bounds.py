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
