"""DAPO's overlong reward shaping and dynamic-sampling group filter (ALGORITHMS.md §5)."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.dapo import groups_with_signal, overlong_penalty


def _naive_penalty(length: int, max_length: int, cache_length: int) -> float:
    """R_len(|y|) piecewise, exactly as written in ALGORITHMS.md §5.4."""
    free = max_length - cache_length
    if length <= free:
        return 0.0
    if length <= max_length:
        return (free - length) / cache_length
    return -1.0


def test_overlong_penalty_hand_values():
    """L_max = 20, L_cache = 5 (ramp over 16..20): values at and around the boundaries."""
    lengths = torch.tensor([0, 14, 15, 16, 18, 19, 20, 21, 100])
    got = overlong_penalty(lengths, max_length=20, cache_length=5)
    assert got.dtype == torch.float32
    expect = torch.tensor([0.0, 0.0, 0.0, -0.2, -0.6, -0.8, -1.0, -1.0, -1.0])
    torch.testing.assert_close(got, expect)


@pytest.mark.parametrize("max_length, cache_length", [(20, 5), (64, 16), (7, 7), (100, 1)])
def test_overlong_penalty_matches_piecewise_formula(max_length, cache_length):
    """Every integer length from 0 to L_max + 5 against the piecewise definition."""
    lengths = torch.arange(0, max_length + 6)
    got = overlong_penalty(lengths, max_length, cache_length)
    expect = torch.tensor([_naive_penalty(n, max_length, cache_length) for n in lengths.tolist()])
    torch.testing.assert_close(got, expect)
    assert float(got[max_length]) == pytest.approx(-1.0)  # exactly L_max: -L_cache/L_cache


def test_overlong_penalty_random_lengths():
    """Random unsorted lengths (int32 and float input) against the piecewise definition."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 300, (50,), generator=g)
    expect = torch.tensor([_naive_penalty(n, 256, 64) for n in lengths.tolist()])
    for x in (lengths, lengths.to(torch.int32), lengths.float()):
        torch.testing.assert_close(overlong_penalty(x, 256, 64), expect)


def test_overlong_penalty_without_cache_is_a_step():
    """cache_length = 0: 0 up to and including L_max, -1 beyond."""
    got = overlong_penalty(torch.tensor([0, 9, 10, 11, 50]), max_length=10, cache_length=0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 0.0, -1.0, -1.0]))


def test_overlong_penalty_whole_range_is_ramp():
    """cache_length = max_length: the ramp starts at 0 (length 5 of 10 → -0.5)."""
    got = overlong_penalty(torch.tensor([0, 5, 10, 11]), max_length=10, cache_length=10)
    torch.testing.assert_close(got, torch.tensor([0.0, -0.5, -1.0, -1.0]))


@pytest.mark.parametrize("max_length, cache_length", [(10, 11), (10, -1), (-1, 0)])
def test_overlong_penalty_invalid_args(max_length, cache_length):
    """cache_length must lie in [0, max_length]."""
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1, 2]), max_length, cache_length)


# --------------------------------------------------------------------------- groups_with_signal


def _naive_signal(rewards, group_ids, atol=0.0):
    """Per-group Python loop: a sample is kept iff its group's max - min exceeds atol."""
    groups: dict[int, list[float]] = {}
    for r, gid in zip(rewards.tolist(), group_ids.tolist(), strict=True):
        groups.setdefault(gid, []).append(r)
    spread = {gid: max(v) - min(v) for gid, v in groups.items()}
    return torch.tensor([spread[gid] > atol for gid in group_ids.tolist()], dtype=torch.bool)


def _grouped(seed, n_groups, binary):
    """Rewards for groups of unequal sizes (1..6), ids shuffled, some groups all-equal."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 7, (n_groups,), generator=g)
    ids = torch.repeat_interleave(torch.arange(n_groups), sizes)
    if binary:
        rewards = torch.randint(0, 2, (len(ids),), generator=g).float()
    else:
        rewards = torch.randn(len(ids), generator=g)
        constant = torch.rand(n_groups, generator=g) < 0.4  # make some groups all-equal
        rewards = torch.where(constant[ids], torch.full_like(rewards, 0.5), rewards)
    perm = torch.randperm(len(ids), generator=g)
    return rewards[perm], ids[perm]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_groups", [1, 3, 12])
@pytest.mark.parametrize("binary", [True, False])
def test_groups_with_signal_matches_loop(seed, n_groups, binary):
    """Vectorised result equals the per-group loop, for shuffled ids and unequal sizes."""
    rewards, ids = _grouped(seed, n_groups, binary)
    got = groups_with_signal(rewards, ids)
    assert got.dtype == torch.bool and got.shape == ids.shape
    assert torch.equal(got, _naive_signal(rewards, ids))


def test_groups_with_signal_sparse_ids_and_atol():
    """Group ids need not be contiguous; atol treats small spreads as no signal."""
    rewards = torch.tensor([0.0, 0.3, 1.0, 1.0, 2.0, 0.0, 5.0])
    ids = torch.tensor([7, 7, 2, 2, 9, 9, 4])
    assert torch.equal(groups_with_signal(rewards, ids), _naive_signal(rewards, ids))
    assert groups_with_signal(rewards, ids).tolist() == [True, True, False, False,
                                                         True, True, False]
    assert groups_with_signal(rewards, ids, atol=0.5).tolist() == [False, False, False, False,
                                                                   True, True, False]
    assert torch.equal(groups_with_signal(rewards, ids, atol=0.5),
                       _naive_signal(rewards, ids, atol=0.5))


def test_groups_all_equal_and_singletons_have_no_signal():
    """All-equal groups (all right, all wrong) and groups of one are False."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.7, 0.0, 1.0])
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    assert groups_with_signal(rewards, ids).tolist() == [False] * 6 + [True, True]
    singles = groups_with_signal(torch.tensor([3.0, -1.0, 2.0]), torch.tensor([2, 0, 1]))
    assert singles.tolist() == [False, False, False]


def test_groups_with_signal_integer_and_float64_rewards():
    """Integer rewards work; float64 rewards keep differences float32 cannot represent."""
    ids = torch.tensor([0, 0, 1, 1])
    assert groups_with_signal(torch.tensor([1, 0, 3, 3]), ids).tolist() == [True, True,
                                                                           False, False]
    close = torch.tensor([1e8, 1e8 + 1, 0.25, 0.25], dtype=torch.float64)
    assert groups_with_signal(close, ids).tolist() == _naive_signal(close, ids).tolist()
    assert groups_with_signal(close, ids).tolist() == [True, True, False, False]


def test_groups_with_signal_empty():
    """No samples: an empty bool tensor."""
    got = groups_with_signal(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert got.shape == (0,) and got.dtype == torch.bool
