"""DAPO's batch-level pieces (Yu et al., arXiv 2503.14476): overlong reward shaping (§3.4)
and the group filter behind dynamic sampling (§3.2)."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_length: int, cache_length: int) -> torch.Tensor:
    """Soft overlong punishment ``R_len(|y|)`` (docs/algorithms.md §5.4), float ``(N,)``.

        0                               |y| ≤ L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache    L_max - L_cache < |y| ≤ L_max
        -1                              |y| > L_max

    Added to the task reward. ``cache_length = 0`` gives the hard step at ``L_max``.
    """
    if not 0 <= cache_length <= max_length:
        raise ValueError(f"need 0 ≤ cache_length ≤ max_length, got {cache_length}, {max_length}")
    lengths = lengths.to(torch.float32)
    free = float(max_length - cache_length)
    ramp = (free - lengths) / max(cache_length, 1)
    penalty = torch.where(lengths <= free, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_length, torch.full_like(lengths, -1.0), penalty)


def groups_with_signal(
    rewards: torch.Tensor, group_ids: torch.Tensor, atol: float = 0.0
) -> torch.Tensor:
    """Bool ``(N,)``: True for samples whose group's rewards are not all equal (max - min >
    ``atol``). Dynamic sampling keeps those groups and resamples to replace the rest; a group
    of one never carries signal."""
    n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    # At least float32, but float64 rewards stay float64 (a cast would merge close rewards).
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    hi = torch.full((n_groups,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, group_ids, r, reduce="amax")
    lo = torch.full((n_groups,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, group_ids, r, reduce="amin")
    return ((hi - lo) > atol)[group_ids]
