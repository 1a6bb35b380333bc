"""Advantage estimators against naive float64 implementations written from ALGORITHMS.md."""

from __future__ import annotations

import math

import pytest
import torch
from masks import SHAPES, random_mask

from bounds import assert_within, moment_errors, unit_roundoff
from posttrain.core.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
)


def random_groups(sizes: list[int], gen: torch.Generator, stride: int = 1) -> torch.Tensor:
    """Shuffled group ids for groups of the given sizes, labelled ``0, stride, 2·stride…``."""
    ids = torch.cat([torch.full((n,), g * stride, dtype=torch.long) for g, n in enumerate(sizes)])
    return ids[torch.randperm(len(ids), generator=gen)]


# --- naive references: plain Python over float64 --------------------------------------------

def naive_group_advantages(rewards, ids, scale_by_std=True, eps=1e-6):
    r = [float(x) for x in rewards]
    g = [int(x) for x in ids]
    out = [0.0] * len(r)
    for gid in set(g):
        members = [i for i in range(len(r)) if g[i] == gid]
        vals = [r[i] for i in members]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))  # population std
        for i in members:
            if all(v == vals[0] for v in vals):
                out[i] = 0.0
            elif scale_by_std:
                out[i] = (r[i] - mean) / (std + eps)
            else:
                out[i] = r[i] - mean
    return torch.tensor(out, dtype=torch.float64)


def naive_rloo(rewards, ids):
    r = [float(x) for x in rewards]
    g = [int(x) for x in ids]
    out = []
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if g[j] == g[i] and j != i]
        out.append(r[i] - sum(others) / len(others) if others else 0.0)
    return torch.tensor(out, dtype=torch.float64)


def naive_gae(rewards, values, mask, gamma, lam):
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        next_v, next_a = 0.0, 0.0
        for t in reversed(idx):
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            a = delta + gamma * lam * next_a
            adv[b, t] = a
            ret[b, t] = a + float(values[b, t])
            next_v, next_a = float(values[b, t]), a
    return adv, ret


def naive_discounted(rewards, mask, gamma):
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        running = 0.0
        for t in reversed([t for t in range(T) if mask[b, t]]):
            running = float(rewards[b, t]) + gamma * running
            out[b, t] = running
    return out


def naive_token_rewards(scores, kl, mask, k):
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        for t in idx:
            out[b, t] = -k * float(kl[b, t])
        if idx:
            out[b, idx[-1]] += float(scores[b])
    return out


# --- error bounds, derived from each estimator's arithmetic (tests/bounds.py) ---------------
#
# Every comparison below is the function (float32, or float64) against the float64 loop, so a
# bound is the sum of both computations' errors: the same arithmetic at u32 and at u64. The
# hand-computed float64 checks on 3-5 values keep assert_close's float64 defaults (1e-7): a
# few u64 (~1e-16) of O(1) values lie 10^9 below them, and every wrong step is ≥ 1e-3 off;
# the float32 ones on dyadic values (0.5, 0.25, integers) are exact. REINFORCE++'s float64
# whitening over ≤ 200 tokens keeps 1e-9 and 1e-6: its rounding is ≤ 200·u64·|x| ~ 1e-13, a
# wrong mean or variance is O(1) off.

U32, U64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)


def _group_bound(rewards, ids, estimator, eps=1e-6, dtype=torch.float32):
    """Element by element, the error of ``group_advantages`` (``"grpo"``, ``"dr_grpo"``) or
    ``rloo_advantages`` (``"rloo"``) in ``dtype`` plus the float64 loop's. GRPO: the mean's,
    the centring's and Σc²'s errors (bounds.moment_errors), then var = Σc²/n (+u·var), std
    (half var's relative error, +u), + eps (+u, and eps's own rounding ≤ u of the sum), and
    A = c/(std + eps): e_c/(std + eps) + |A|·(std + eps's relative error + u). RLOO: the
    sum's (n−1)·u·Σ|r|, the subtraction's u·|Σ − r_i| (both over n − 1), the division's
    u·|others| and the final subtraction's u·|A|. Constant groups and groups of one are 0
    exactly (bound 0). The bounds here are ≤ 3e-5: a 1% error of these O(1) advantages is
    300 times beyond."""
    x_all = rewards.double()
    out = torch.zeros(len(ids), dtype=torch.float64)
    for gid in ids.unique():
        members = ids == gid
        x, n = x_all[members], int(members.sum())
        if n == 1 or bool((x == x[0]).all()):
            continue
        for dt in (dtype, torch.float64):
            u = unit_roundoff(dt)
            if estimator == "rloo":
                total = x.sum()
                others = (total - x) / (n - 1)
                a = x - others
                out[members] += ((n - 1) * u * x.abs().sum() + u * (total - x).abs()) / (n - 1) \
                    + u * (others.abs() + a.abs())
                continue
            _, c, _, e_c, sumsq, e_sumsq = moment_errors(x, dt)
            if estimator == "dr_grpo":
                out[members] += e_c
                continue
            var = sumsq / n
            std = math.sqrt(var)
            e_std = (e_sumsq / n + u * var) / (2 * std) + u * std
            d = std + eps
            e_d = e_std + 2 * u * d
            a = c / d
            out[members] += e_c / d + a.abs() * (e_d / d + u)
    return out


def _gae_error(rewards, values, mask, gamma, lam):
    """Element by element, GAE's error in units of u (multiply by u32 + u64 for float32 against
    the float64 loop, which rounds the same operations): δ = R + γ·V' − V rounds γ (a float32
    constant) and the product (2u·|γV'|), the sum (u·|R + γV'|) and the difference (u·|δ|);
    A = δ + γλ·A' rounds γλ and the product (2u·|γλA'|) and the sum (u·|A|), and carries A''s
    error times γλ. Returns (advantages, returns = A + V: one more u·|A + V|). With V = 0 and
    λ = 1 it bounds the discounted returns (the same operations less the exact ones)."""
    B, T = mask.shape
    adv, ret = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        next_v = next_a = next_e = 0.0
        for t in reversed([t for t in range(T) if mask[b, t]]):
            r, v = float(rewards[b, t]), float(values[b, t])
            s1 = r + gamma * next_v
            a = s1 - v + gamma * lam * next_a
            e = (2 * abs(gamma * next_v) + abs(s1) + abs(s1 - v) + 2 * abs(gamma * lam * next_a)
                 + abs(a) + gamma * lam * next_e)
            adv[b, t], ret[b, t] = e, e + abs(a + v)
            next_v, next_a, next_e = v, a, e
    return adv, ret


# --- group statistics ------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [[4, 4, 4], [1, 2, 3, 5, 8], [7], [2, 1, 6, 3, 3, 1]])
@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_group_advantages_match_per_group_loop(sizes, stride, seed):
    """Vectorised GRPO advantages equal a per-group loop, for unequal sizes, shuffled ids and
    non-contiguous labels, with and without division by the std."""
    gen = torch.Generator().manual_seed(seed)
    ids = random_groups(sizes, gen, stride)
    rewards = torch.randn(len(ids), generator=gen) * 3 + 1
    for scale in (True, False):
        got = group_advantages(rewards, ids, scale_by_std=scale)
        want = naive_group_advantages(rewards, ids, scale_by_std=scale)
        assert_within(got, want, 1.0, _group_bound(rewards, ids, "grpo" if scale else "dr_grpo"),
                      f"scale_by_std={scale}")


def test_group_advantages_use_population_std():
    """Rewards (0, 2): population std 1, so A = ±1/(1+eps); the sample std √2 would give
    ±0.707."""
    rewards, ids = torch.tensor([0.0, 2.0]), torch.tensor([0, 0])
    adv = group_advantages(rewards, ids, eps=1e-6)
    # within the derived bound (a few u32 of 1); the sample std is 30% off
    assert_within(adv, torch.tensor([-1.0, 1.0], dtype=torch.float64) / (1.0 + 1e-6), 1.0,
                  _group_bound(rewards, ids, "grpo"))
    # (1, 2, 6): mean 3, population var (4 + 1 + 9) / 3 = 14/3
    rewards, ids = torch.tensor([1.0, 2.0, 6.0]), torch.tensor([0, 0, 0])
    adv = group_advantages(rewards, ids, eps=0.0)
    s = math.sqrt(14 / 3)
    assert_within(adv, torch.tensor([-2 / s, -1 / s, 3 / s], dtype=torch.float64), 1.0,
                  _group_bound(rewards, ids, "grpo", eps=0.0))


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.7, 3.3, -2.5, 1e5 + 0.3, 123456.7])
@pytest.mark.parametrize("size", [2, 3, 7, 16])
def test_all_equal_groups_give_exactly_zero(value, size):
    """A group whose rewards are all equal has advantage exactly 0 (never NaN, never the
    rounding error of the mean divided by an equally tiny std)."""
    ids = torch.tensor([0] * size + [1, 1])
    rewards = torch.tensor([value] * size + [0.0, 1.0])
    for adv in (group_advantages(rewards, ids), group_advantages(rewards, ids, scale_by_std=False),
                rloo_advantages(rewards, ids)):
        assert not adv.isnan().any()
        assert torch.equal(adv[:size], torch.zeros(size))
        assert (adv[size:] != 0).all()  # the other group still carries signal


def test_integer_rewards_all_equal():
    """Integer (0/1 correctness) rewards work, and all-right / all-wrong groups give 0."""
    rewards = torch.tensor([1, 1, 1, 0, 0, 0, 1, 0])
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    adv = group_advantages(rewards, ids)
    assert adv.is_floating_point()
    assert_within(adv, naive_group_advantages(rewards, ids), 1.0,
                  _group_bound(rewards.float(), ids, "grpo"))
    assert torch.equal(adv[:6], torch.zeros(6))
    assert torch.equal(rloo_advantages(rewards, ids), torch.tensor([0.0] * 6 + [1.0, -1.0]))


def test_groups_of_size_one_give_zero():
    """Every group of one member gets advantage 0 from every group estimator."""
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(6, generator=gen)
    ids = torch.randperm(6, generator=gen)
    for adv in (group_advantages(rewards, ids), group_advantages(rewards, ids, scale_by_std=False),
                rloo_advantages(rewards, ids)):
        assert torch.equal(adv, torch.zeros(6))


def test_dr_grpo_is_mean_centring():
    """scale_by_std=False gives r_i - mean(group) (Dr. GRPO), by hand."""
    rewards = torch.tensor([1.0, 4.0, 10.0, 0.0, 2.0])
    ids = torch.tensor([0, 1, 0, 1, 0])
    # group 0: (1, 10, 2), mean 13/3; group 1: (4, 0), mean 2
    want = torch.tensor([1 - 13 / 3, 2.0, 10 - 13 / 3, -2.0, 2 - 13 / 3], dtype=torch.float64)
    assert_within(group_advantages(rewards, ids, scale_by_std=False), want, 1.0,
                  _group_bound(rewards, ids, "dr_grpo"))


@pytest.mark.parametrize("sizes", [[2, 2], [1, 2, 3, 5, 8], [6], [3, 1, 4, 1, 5]])
@pytest.mark.parametrize("seed", [0, 1])
def test_rloo_matches_per_sample_loop(sizes, seed):
    """RLOO advantages equal r_i minus the mean of the other members of the group."""
    gen = torch.Generator().manual_seed(seed)
    ids = random_groups(sizes, gen, stride=2)
    rewards = torch.randn(len(ids), generator=gen) * 2
    assert_within(rloo_advantages(rewards, ids), naive_rloo(rewards, ids), 1.0,
                  _group_bound(rewards, ids, "rloo"))


def test_rloo_by_hand():
    """Group (1, 2, 6): A = 1-4, 2-3.5, 6-1.5; group (5, 3): A = 2, -2."""
    adv = rloo_advantages(torch.tensor([1.0, 5.0, 2.0, 3.0, 6.0]), torch.tensor([0, 1, 0, 1, 0]))
    # small integers and halves: every sum, difference and quotient is exact in float32
    torch.testing.assert_close(adv, torch.tensor([-3.0, 2.0, -1.5, -2.0, 4.5]), rtol=0, atol=0)


def _split(ids, rewards, ks):
    """Each sample ``i`` as ``ks[i]`` rows sharing its reward (a split agent episode's
    trajectories): the rows' group ids, rewards, sample ids, and each row's sample."""
    rows = torch.tensor([i for i, k in enumerate(ks) for _ in range(k)])
    return ids[rows], rewards[rows], rows * 5 + 3, rows  # (sample ids need not be dense)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_samples_count_once_in_their_group(seed):
    """With ``sample_ids``, a sample split into k rows counts once in its group's mean, std
    and leave-one-out baseline: every row gets its sample's advantage. Integer rewards in
    groups of 2 or 4 samples and k in {1, 2, 4}: every share, sum and mean is exact in
    float32, so the rows' advantages equal the samples' bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    ids = random_groups([4, 2, 4, 2], gen)
    rewards = torch.randint(-3, 4, (len(ids),), generator=gen).float()
    ks = [int(2 ** torch.randint(0, 3, (1,), generator=gen)) for _ in range(len(ids))]
    row_ids, row_rewards, sample_ids, sample = _split(ids, rewards, ks)
    for got, want in [
            (group_advantages(row_rewards, row_ids, sample_ids=sample_ids),
             group_advantages(rewards, ids)),
            (group_advantages(row_rewards, row_ids, scale_by_std=False, sample_ids=sample_ids),
             group_advantages(rewards, ids, scale_by_std=False)),
            (rloo_advantages(row_rewards, row_ids, sample_ids), rloo_advantages(rewards, ids))]:
        assert torch.equal(got, want[sample])
    assert not torch.equal(group_advantages(row_rewards, row_ids), group_advantages(
        rewards, ids)[sample]) or all(k == ks[0] for k in ks)  # (rows counted: otherwise)
    one = torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0, 1.0]), torch.tensor([7, 7, 7])
    assert torch.equal(rloo_advantages(one[1] * 2, one[0], one[2]), torch.zeros(3))  # (G = 1)


@pytest.mark.parametrize("seed", [0, 1])
def test_split_samples_match_the_float64_loop(seed):
    """Random rewards, each group's samples split into the same k rows (k = 1, 2 or 4 per
    group): the per-sample float64 loop's advantages, on every row. Bound: the shares 1/k
    and their products are exact (powers of two), and every weighted sum runs over the
    same rows as the unweighted computation on the rows — whose statistics, with k rows a
    sample, are the samples' — with terms scaled by 1/k, so its rounding is within that
    computation's (``_group_bound`` of the rows)."""
    gen = torch.Generator().manual_seed(seed)
    ids = random_groups([4, 3, 5, 2], gen, stride=2)
    rewards = torch.randn(len(ids), generator=gen) * 3 + 1
    k_of = {int(g): 2 ** (int(g) % 3) for g in ids.unique()}
    ks = [k_of[int(g)] for g in ids]
    row_ids, row_rewards, sample_ids, sample = _split(ids, rewards, ks)
    for scale, mode in ((True, "grpo"), (False, "dr_grpo")):
        got = group_advantages(row_rewards, row_ids, scale_by_std=scale, sample_ids=sample_ids)
        want = naive_group_advantages(rewards, ids, scale_by_std=scale)[sample]
        assert_within(got, want, 1.0, _group_bound(row_rewards, row_ids, mode), mode)


# --- GAE and returns -------------------------------------------------------------------------

def test_gae_hand_computed_three_tokens():
    """γ = 0.9, λ = 0.5, R = (0, 0, 1), V = (0.5, 0.4, 0.6), inside a row with a prompt token
    before and padding after (garbage rewards/values there must be ignored)."""
    # t=2: δ = 1 + 0.9·0   - 0.6 =  0.4 ;  A2 = 0.4
    # t=1: δ = 0 + 0.9·0.6 - 0.4 =  0.14;  A1 = 0.14 + 0.45·0.4  = 0.32
    # t=0: δ = 0 + 0.9·0.4 - 0.5 = -0.14;  A0 = -0.14 + 0.45·0.32 = 0.004
    # returns = A + V = (0.504, 0.72, 1.0)
    rewards = torch.tensor([[5.0, 0.0, 0.0, 1.0, 7.0, -3.0]], dtype=torch.float64)
    values = torch.tensor([[9.0, 0.5, 0.4, 0.6, 8.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0, 0.004, 0.32, 0.4, 0, 0]],
                                                 dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0, 0.504, 0.72, 1.0, 0, 0]],
                                                 dtype=torch.float64))


def test_gae_hand_computed_four_tokens_monte_carlo():
    """γ = λ = 1: A_t = Σ_{k≥t} R_k - V_t. R = (0.1, -0.2, 0, 1), V = (0.3, 0.2, 0.5, 0.7)."""
    # suffix sums of R: (0.9, 0.8, 1.0, 1.0); A = (0.9-0.3, 0.8-0.2, 1-0.5, 1-0.7)
    rewards = torch.tensor([[0.1, -0.2, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.3, 0.2, 0.5, 0.7]], dtype=torch.float64)
    adv, ret = gae(rewards, values, torch.ones(1, 4), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.6, 0.6, 0.5, 0.3]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.9, 0.8, 1.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(discounted_returns(rewards, torch.ones(1, 4), 1.0), ret)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_python_loop(shape, holes, seed):
    """GAE equals a plain loop over each row's unmasked tokens (random γ, λ); returns are
    advantages + values; masked positions hold 0."""
    gen = torch.Generator().manual_seed(seed)
    B, T = shape
    mask = random_mask(B, T, gen, holes)
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    gamma, lam = torch.rand(2, generator=gen, dtype=torch.float64).tolist()
    adv, ret = gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = naive_gae(rewards, values, mask, gamma, lam)
    e_adv, e_ret = _gae_error(rewards, values, mask, gamma, lam)
    assert_within(adv, want_adv, 2 * U64, e_adv, "advantages")  # two float64 computations
    assert_within(ret, want_ret, 2 * U64, e_ret, "returns")
    # the function's returns are its own advantages plus the values, one rounding: bitwise
    assert torch.equal(ret, torch.where(mask, adv + values, 0.0))


def test_gae_float32_matches_loop():
    """GAE on float32 inputs agrees with the float64 loop to float32 precision."""
    gen = torch.Generator().manual_seed(5)
    mask = random_mask(6, 12, gen)
    rewards, values = torch.randn(2, 6, 12, generator=gen)
    adv, ret = gae(rewards, values, mask, 0.99, 0.95)
    want_adv, want_ret = naive_gae(rewards, values, mask, 0.99, 0.95)
    assert adv.dtype == torch.float32
    # the recursion's roundings over ≤ 12 tokens (_gae_error), ~1e-6 of these O(1) values: a
    # 1% error, or a token's δ dropped, is 10^3 and more beyond
    e_adv, e_ret = _gae_error(rewards.double(), values.double(), mask, 0.99, 0.95)
    assert_within(adv, want_adv, U32 + U64, e_adv, "advantages")
    assert_within(ret, want_ret, U32 + U64, e_ret, "returns")


def _pad(x: torch.Tensor, left: int, right: int, fill: float) -> torch.Tensor:
    return torch.cat([torch.full((left,), fill, dtype=x.dtype), x,
                      torch.full((right,), fill, dtype=x.dtype)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_and_returns_do_not_depend_on_padding(seed):
    """The same trajectory left-padded, right-padded, or behind a prompt, with garbage in the
    masked slots, gives the same values on its response tokens."""
    gen = torch.Generator().manual_seed(seed)
    L, T = 5, 11
    r = torch.randn(L, generator=gen, dtype=torch.float64)
    v = torch.randn(L, generator=gen, dtype=torch.float64)
    layouts = [(T - L, 0), (0, T - L), (3, T - L - 3)]
    rewards = torch.stack([_pad(r, a, b, 4.0) for a, b in layouts])
    values = torch.stack([_pad(v, a, b, -6.0) for a, b in layouts])
    mask = torch.stack([_pad(torch.ones(L), a, b, 0.0) for a, b in layouts]).bool()
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    disc = discounted_returns(rewards, mask, gamma=0.8)
    for out in (adv, ret, disc):
        picked = out[mask].view(len(layouts), L)
        for row in picked[1:]:
            # the same elementwise IEEE operations (each correctly rounded at any vector
            # width) on the same values, in whichever column they sit: bitwise equal
            assert torch.equal(row, picked[0])
        assert torch.equal(out[~mask], torch.zeros(int((~mask).sum()), dtype=out.dtype))


def test_gae_ignores_non_finite_values_at_masked_positions():
    """inf/NaN in masked slots of rewards or values (e.g. a critic's output on padding) does
    not leak into advantages or returns."""
    rewards = torch.tensor([[float("inf"), 0.0, 1.0, float("nan")]])
    values = torch.tensor([[float("nan"), 0.5, 0.25, float("-inf")]])
    mask = torch.tensor([[0, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # t=2: A = 1 - 0.25 = 0.75; t=1: δ = 0 + 0.25 - 0.5 = -0.25, A = -0.25 + 0.75 = 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5, 0.75, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.0, 1.0, 0.0]]))
    disc = discounted_returns(rewards, mask, gamma=1.0)
    torch.testing.assert_close(disc, torch.tensor([[0.0, 1.0, 1.0, 0.0]]))


def test_discounted_returns_by_hand():
    """R = (1, 2, 3), γ = 0.5, behind one prompt token: G = (1 + 0.5·3.5, 2 + 0.5·3, 3)."""
    rewards = torch.tensor([[9.0, 1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5),
                               torch.tensor([[0.0, 2.75, 3.5, 3.0, 0.0]]))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("holes", [False, True])
def test_discounted_returns_match_loop(shape, holes):
    """G_t = R_t + γ G_{t+1} over unmasked tokens equals a plain loop (random γ)."""
    gen = torch.Generator().manual_seed(sum(shape))
    B, T = shape
    mask = random_mask(B, T, gen, holes)
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    gamma = float(torch.rand(1, generator=gen))
    # two float64 recursions: GAE's bound with V = 0, λ = 1 (_gae_error)
    e_ret, _ = _gae_error(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    assert_within(discounted_returns(rewards, mask, gamma), naive_discounted(rewards, mask, gamma),
                  2 * U64, e_ret)


# --- token-level rewards and REINFORCE++ -----------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_token_level_rewards_match_loop(shape, seed):
    """Score on the last unmasked token, -k·KL on every unmasked token, nothing elsewhere;
    empty rows get nothing (and inf KL in masked slots does not leak)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = shape
    mask = random_mask(B, T, gen)
    kl = torch.randn(B, T, generator=gen, dtype=torch.float64)
    kl[~mask] = float("inf")
    scores = torch.randn(B, generator=gen, dtype=torch.float64) * 5
    got = token_level_rewards(scores, kl, mask, kl_coef=0.3)
    # float64 both, the same two roundings (−k·KL, then + score on the last token): bitwise
    assert torch.equal(got, naive_token_rewards(scores, kl, mask, 0.3))
    empty = ~mask.any(dim=1)
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))


def test_token_level_rewards_by_hand():
    """Row 0: prompt, 3 tokens, padding; row 1 empty; k = 0.5, KL = 1 everywhere."""
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 0, 0]])
    got = token_level_rewards(torch.tensor([2.0, 7.0]), torch.ones(2, 5), mask, 0.5)
    want = torch.tensor([[0.0, -0.5, -0.5, 1.5, 0.0], [0.0] * 5])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("shape", [(3, 4), (6, 9), (10, 20)])
def test_reinforce_pp_whitened_over_masked_tokens(shape):
    """REINFORCE++: returns are the discounted token rewards; advantages are those returns
    whitened over the batch's unmasked tokens (masked mean 0, population var 1) and 0 at
    masked positions."""
    gen = torch.Generator().manual_seed(shape[1])
    B, T = shape
    mask = random_mask(B, T, gen)
    mask[0, T // 2:] = True
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64) * 3 + 1
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.9)
    torch.testing.assert_close(ret, naive_discounted(rewards, mask, 0.9))
    vals = [float(adv[b, t]) for b in range(B) for t in range(T) if mask[b, t]]
    mean = sum(vals) / len(vals)
    var = sum((x - mean) ** 2 for x in vals) / len(vals)
    assert abs(mean) < 1e-9
    assert abs(var - 1.0) < 1e-6
    rets = [float(ret[b, t]) for b in range(B) for t in range(T) if mask[b, t]]
    rm = sum(rets) / len(rets)
    rs = math.sqrt(sum((x - rm) ** 2 for x in rets) / len(rets) + 1e-8)
    want = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                want[b, t] = (float(ret[b, t]) - rm) / rs
    torch.testing.assert_close(adv, want)


# --- no gradient ----------------------------------------------------------------------------

def test_advantage_functions_return_constants():
    """Every estimator returns tensors with requires_grad False even for inputs that require
    grad."""
    gen = torch.Generator().manual_seed(0)
    mask = random_mask(4, 6, gen)
    rewards = torch.randn(4, generator=gen, requires_grad=True)
    tok = torch.randn(4, 6, generator=gen, requires_grad=True)
    values = torch.randn(4, 6, generator=gen, requires_grad=True)
    kl = torch.randn(4, 6, generator=gen, requires_grad=True)
    ids = torch.tensor([0, 0, 1, 1])
    outs = [
        group_advantages(rewards, ids),
        group_advantages(rewards, ids, scale_by_std=False),
        rloo_advantages(rewards, ids),
        *gae(tok, values, mask),
        discounted_returns(tok, mask),
        token_level_rewards(rewards, kl, mask, 0.1),
        *reinforce_pp_advantages(tok, mask),
    ]
    for out in outs:
        assert not out.requires_grad
        assert out.grad_fn is None
