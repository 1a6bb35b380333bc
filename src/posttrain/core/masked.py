"""Masked reductions over ``(B, T)`` tensors.

Every function treats positions where ``mask`` is 0 as absent: they never enter a sum, a mean
or a count, and an inf or NaN sitting at a masked position does not leak (we select with
``torch.where`` instead of multiplying by the mask, because ``inf * 0`` is NaN).
An empty mask gives 0, never NaN.
"""

from __future__ import annotations

import torch


def _zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with masked positions replaced by 0, so an inf/NaN there cannot reach a value
    or (through ``0 · inf`` in a backward pass) a gradient."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``Σ m·x`` over ``dim`` (all dimensions when ``None``)."""
    x = _zero_masked(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of unmasked positions, as a float tensor."""
    m = mask.bool().to(torch.float32)
    return m.sum() if dim is None else m.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``Σ m·x / Σ m``; 0 where the mask is empty."""
    count = masked_count(mask, dim).to(x.dtype)
    return masked_sum(x, mask, dim) / count.clamp_min(1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the unmasked entries of ``x`` (over all dimensions).

    With ``unbiased`` the sum of squares is divided by ``n - 1`` (Bessel), else by ``n``.
    Fewer than two entries (one, for the population variance) give 0.
    """
    x = _zero_masked(x, mask)
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    n = masked_count(mask).to(x.dtype)
    denom = n - 1.0 if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp_min(1.0), torch.zeros_like(sq))


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with statistics over the unmasked entries.

    With ``shift_mean=False`` the mean is added back (only the scale changes). Masked
    positions come out as 0.
    """
    x = _zero_masked(x, mask)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=False)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))


def masked_min_max(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum and maximum of the unmasked entries; both 0 for an empty mask (a tensor with
    no elements included)."""
    m = mask.bool()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if m.numel() == 0:  # amin/amax refuse an empty reduction
        return zero, zero.clone()
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    lo = torch.where(m, x, inf).amin()
    hi = torch.where(m, x, -inf).amax()
    any_ = m.any()
    return torch.where(any_, lo, zero), torch.where(any_, hi, zero)


class RunningMoments:
    """Mean and standard deviation of every value seen so far (Chan et al.'s parallel update,
    in float64), for normalising reward-model scores across steps rather than per batch."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def std(self) -> float:
        return (self.m2 / (self.count - 1)) ** 0.5 if self.count > 1 else 1.0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().flatten()
        x = x[torch.isfinite(x)]
        n = x.numel()
        if n == 0:
            return
        mean = float(x.mean())
        m2 = float(((x - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        return (x - self.mean) / max(self.std, eps)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), state["mean"], state["m2"]
