"""The algorithm table: defaults, validation, advantage dispatch, objective, invariance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posttrain.core.advantages import (
    gae,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
)
from posttrain.core.aggregate import aggregate_loss, step_normalizer
from posttrain.core.algorithms import (
    ALGORITHMS,
    Algorithm,
    PolicyInputs,
    compute_advantages,
    get_algorithm,
    policy_objective,
)
from posttrain.core.masked import masked_whiten
from posttrain.core.policy import gspo_loss, gspo_token_loss, ppo_clip_loss

# name: (advantage, policy loss, aggregation, clip_low, clip_high, β, reward k, critic),
# written out from the table in ALGORITHMS.md / the module docstring
EXPECTED = {
    "ppo": ("gae", "ppo_clip", "token_mean", 0.2, 0.2, 0.0, 0.05, True),
    "grpo": ("group", "ppo_clip", "seq_mean", 0.2, 0.2, 0.04, 0.0, False),
    "dapo": ("group", "ppo_clip", "token_mean", 0.2, 0.28, 0.0, 0.0, False),
    "gspo": ("group", "gspo", "seq_mean", 3e-4, 4e-4, 0.0, 0.0, False),
    "gspo_token": ("group", "gspo_token", "seq_mean", 3e-4, 4e-4, 0.0, 0.0, False),
    "dr_grpo": ("group_no_std", "ppo_clip", "seq_sum_const", 0.2, 0.2, 0.0, 0.0, False),
    "rloo": ("rloo", "ppo_clip", "seq_mean", 0.2, 0.2, 0.04, 0.0, False),
    "reinforce_pp": ("reinforce_pp", "ppo_clip", "token_mean", 0.2, 0.2, 0.0, 0.01, False),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", "ppo_clip", "token_mean", 0.2, 0.2,
                              0.0, 0.01, False),
}
NEEDS_REFERENCE = {"ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
NEEDS_GROUPS = {"grpo", "dapo", "gspo", "gspo_token", "dr_grpo", "rloo", "reinforce_pp_baseline"}


def test_table_has_exactly_the_expected_entries():
    """The table holds the nine documented algorithms, each keyed by its own name."""
    assert set(ALGORITHMS) == set(EXPECTED)
    for name, algo in ALGORITHMS.items():
        assert algo.name == name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_entry_fields_and_reconstruction(name):
    """Each entry has the documented fields and re-constructs (validation passes) from them."""
    algo = get_algorithm(name)
    assert algo is ALGORITHMS[name]
    got = (algo.advantage, algo.policy_loss, algo.aggregation, algo.clip_low, algo.clip_high,
           algo.kl_coef, algo.reward_kl_coef, algo.critic)
    assert got == EXPECTED[name]
    assert Algorithm(**dataclasses.asdict(algo)) == algo
    assert algo.needs_reference == (name in NEEDS_REFERENCE)
    assert algo.needs_groups == (name in NEEDS_GROUPS)


def test_paper_defaults():
    """DAPO: clip 0.2/0.28, token_mean, β 0, dynamic sampling and overlong shaping; GSPO:
    3e-4/4e-4, seq_mean; GRPO: 0.2/0.2, β 0.04 with k3, seq_mean."""
    dapo, gspo, grpo = (get_algorithm(n) for n in ("dapo", "gspo", "grpo"))
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation, dapo.kl_coef) == (
        0.2, 0.28, "token_mean", 0.0)
    assert dapo.dynamic_sampling and dapo.overlong_shaping
    assert (gspo.clip_low, gspo.clip_high, gspo.aggregation) == (3e-4, 4e-4, "seq_mean")
    assert (grpo.clip_low, grpo.clip_high, grpo.kl_coef, grpo.kl_estimator,
            grpo.aggregation) == (0.2, 0.2, 0.04, "k3", "seq_mean")
    assert not grpo.dynamic_sampling


def test_overrides_apply_and_leave_table_untouched():
    """get_algorithm with overrides returns a changed copy; the table entry is unchanged and
    needs_reference / needs_groups follow the new fields."""
    a = get_algorithm("grpo", kl_coef=0.0, clip_high=0.28)
    assert (a.kl_coef, a.clip_high, a.name) == (0.0, 0.28, "grpo")
    assert not a.needs_reference
    assert ALGORITHMS["grpo"].kl_coef == 0.04
    assert get_algorithm("dapo", kl_coef=0.1).needs_reference
    assert not get_algorithm("grpo", advantage="reinforce_pp").needs_groups
    assert get_algorithm("grpo", advantage="gae", critic=True).critic


@pytest.mark.parametrize("overrides", [
    {"advantage": "bogus"},
    {"aggregation": "mean"},
    {"policy_loss": "dpo"},
    {"kl_estimator": "k4"},
    {"reward_kl_estimator": "exact"},
    {"advantage": "gae"},          # GAE without a critic
    {"clip_low": 1.0},
    {"clip_low": -0.1},
    {"clip_high": -0.1},
])
def test_invalid_overrides_raise(overrides):
    """Bad estimator / aggregation / loss / KL estimator / clip, and GAE without critic, are
    ValueErrors."""
    with pytest.raises(ValueError):
        get_algorithm("grpo", **overrides)


def test_ppo_without_critic_and_unknown_name_raise():
    """Switching PPO's critic off, and asking for an unknown algorithm, raise ValueError."""
    with pytest.raises(ValueError):
        get_algorithm("ppo", critic=False)
    with pytest.raises(ValueError):
        get_algorithm("trpo")


# --- advantages ------------------------------------------------------------------------------

def batch(B=12, T=9, seed=0, dtype=torch.float32):
    """Scores, group ids (4 shuffled groups of 3, one all-equal), mask (prompt, padding, one
    empty row), old/ref logprobs and critic values."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.arange(B) // 3
    ids = ids[torch.randperm(B, generator=gen)]
    scores = torch.randn(B, generator=gen).to(dtype)
    scores[ids == 2] = 0.5
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        start = int(torch.randint(0, 3, (1,), generator=gen))
        length = 0 if i == 4 else int(torch.randint(1, T - start + 1, (1,), generator=gen))
        mask[i, start:start + length] = True
    old = (-torch.rand(B, T, generator=gen) * 3).to(dtype)
    ref = (old + torch.randn(B, T, generator=gen) * 0.3).to(dtype)
    values = torch.randn(B, T, generator=gen).to(dtype)
    return scores, ids, mask, old, ref, values


def direct_advantages(name, scores, ids, mask, old, ref, values):
    """The underlying function called directly, per the table."""
    algo = ALGORITHMS[name]

    def broadcast(a):
        return torch.where(mask, a[:, None].float(), 0.0)

    if algo.advantage == "group":
        return broadcast(group_advantages(scores, ids)), None
    if algo.advantage == "group_no_std":
        return broadcast(group_advantages(scores, ids, scale_by_std=False)), None
    if algo.advantage == "rloo":
        return broadcast(rloo_advantages(scores, ids)), None
    kl1 = old.float() - ref.float()  # the k1 reward-KL estimate
    if algo.advantage == "gae":
        rewards = token_level_rewards(scores, kl1, mask, algo.reward_kl_coef)
        adv, ret = gae(rewards, values, mask, algo.gamma, algo.lam)
        return masked_whiten(adv, mask), ret
    if algo.advantage == "reinforce_pp_baseline":
        scores = group_advantages(scores, ids, scale_by_std=False)
    rewards = token_level_rewards(scores, kl1, mask, algo.reward_kl_coef)
    return reinforce_pp_advantages(rewards, mask, algo.gamma)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_compute_advantages_equals_direct_call(name):
    """compute_advantages dispatches to the documented estimator with the table's
    hyper-parameters; outputs are constants and 0 at masked positions."""
    scores, ids, mask, old, ref, values = batch()
    for t in (scores, old, ref, values):
        t.requires_grad_(True)
    adv, ret = compute_advantages(ALGORITHMS[name], scores, ids, mask, old, ref, values)
    with torch.no_grad():
        want_adv, want_ret = direct_advantages(name, scores, ids, mask, old, ref, values)
    torch.testing.assert_close(adv, want_adv)
    assert not adv.requires_grad
    assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum())))
    if want_ret is None:
        assert ret is None
    else:
        torch.testing.assert_close(ret, want_ret)
        assert not ret.requires_grad
    if ALGORITHMS[name].needs_groups and name != "reinforce_pp_baseline":
        assert torch.equal(adv[ids == 2], torch.zeros_like(adv[ids == 2]))  # all-equal group


def test_reward_kl_changes_token_advantages():
    """For PPO / REINFORCE++ the reference enters through the reward KL: another ref gives
    other advantages (so the direct-call test above is not blind to ref)."""
    scores, ids, mask, old, ref, values = batch()
    for name in ("ppo", "reinforce_pp"):
        a1, _ = compute_advantages(ALGORITHMS[name], scores, ids, mask, old, ref, values)
        a2, _ = compute_advantages(ALGORITHMS[name], scores, ids, mask, old, ref + 1.0, values)
        assert (a1 - a2).abs().max() > 1e-3


def test_gae_estimator_needs_values():
    """compute_advantages for PPO without critic values is a ValueError."""
    scores, ids, mask, old, ref, _ = batch()
    with pytest.raises(ValueError):
        compute_advantages(ALGORITHMS["ppo"], scores, ids, mask, old, ref, None)


# --- objective -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [*sorted(EXPECTED), "grpo+dual_clip"])
def test_policy_objective_is_loss_plus_k3_penalty(name):
    """policy_objective = the table's policy loss (with the table's clip range and dual clip)
    + β·k3(ℓ, ℓ_ref) on unmasked tokens, with metrics['kl'] the masked mean of k3."""
    scores, ids, mask, old, ref, values = (x.double() if x.is_floating_point() else x
                                           for x in batch())
    algo = get_algorithm("grpo", dual_clip=1.5) if name == "grpo+dual_clip" else ALGORITHMS[name]
    gen = torch.Generator().manual_seed(1)
    spread = 3e-4 if algo.clip_low < 1e-2 else 0.3
    lp = old + torch.randn(old.shape, generator=gen, dtype=torch.float64) * spread
    adv, _ = compute_advantages(algo, scores, ids, mask, old, ref, values)
    if algo.advantage != "gae":  # token-varying advantages tell gspo from gspo_token
        adv = adv + torch.randn(adv.shape, generator=gen, dtype=torch.float64)
    loss, metrics = policy_objective(algo, PolicyInputs(lp, old, adv, mask, ref))
    base = {"ppo_clip": lambda: ppo_clip_loss(lp, old, adv, mask, algo.clip_low, algo.clip_high,
                                              algo.dual_clip),
            "gspo": lambda: gspo_loss(lp, old, adv, mask, algo.clip_low, algo.clip_high),
            "gspo_token": lambda: gspo_token_loss(lp, old, adv, mask, algo.clip_low,
                                                  algo.clip_high)}[algo.policy_loss]()[0]
    r = ref - lp
    k3 = torch.where(mask, r.exp() - r - 1, 0.0)
    torch.testing.assert_close(loss, base + algo.kl_coef * k3)
    if algo.kl_coef > 0:
        assert metrics["kl"].item() == pytest.approx(float(k3.sum() / mask.sum()))
    else:
        assert "kl" not in metrics


def test_policy_objective_with_kl_needs_reference():
    """kl_coef > 0 without ref_logprobs is a ValueError."""
    _, _, mask, old, _, _ = batch()
    with pytest.raises(ValueError):
        policy_objective(ALGORITHMS["grpo"], PolicyInputs(old, old, torch.ones(old.shape[0]), mask))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_policy_objective_gradient_only_through_logprobs(name):
    """advantages, old_logprobs and ref_logprobs get no gradient even when they require
    grad; logprobs do."""
    scores, ids, mask, old, ref, values = batch()
    algo = ALGORITHMS[name]
    adv, _ = compute_advantages(algo, scores, ids, mask, old, ref, values)
    gen = torch.Generator().manual_seed(2)
    lp = (old + torch.randn(old.shape, generator=gen) * 1e-4).requires_grad_(True)
    for t in (adv, old, ref):
        t.requires_grad_(True)
    loss, _ = policy_objective(algo, PolicyInputs(lp, old, adv, mask, ref))
    aggregate_loss(loss, mask, algo.aggregation).backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    for t in (adv, old, ref):
        assert t.grad is None or not t.grad.any()


# --- micro-batch invariance for every algorithm ----------------------------------------------

@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("size", [1, 4, 16])
def test_micro_batch_invariance_every_algorithm(name, size):
    """For each algorithm: advantages once on the full batch of 16, then micro-batches of
    1/4/16 sequences aggregated with the full step's normaliser; the summed gradient of a
    shared float64 weight equals the full-batch gradient to 1e-6."""
    algo = ALGORITHMS[name]
    B, T, V, d = 16, 10, 6, 4
    gen = torch.Generator().manual_seed(7)
    feats = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        start = int(torch.randint(0, 3, (1,), generator=gen))
        length = 0 if i == 9 else int(torch.randint(1, T - start + 1, (1,), generator=gen))
        mask[i, start:start + length] = True
    weight0 = torch.randn(d, V, generator=gen, dtype=torch.float64) * 0.5

    def logprobs(w, sl):
        logp = torch.log_softmax(feats[sl] @ w, dim=-1)
        return logp.gather(-1, tokens[sl, :, None]).squeeze(-1)

    with torch.no_grad():
        base = logprobs(weight0, slice(None))
    # old policy close enough that the small GSPO clip range is partly active
    spread = 3e-4 if algo.clip_low < 1e-2 else 0.2
    old = base + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    ref = base + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    ids = (torch.arange(B) // 4)[torch.randperm(B, generator=gen)]
    adv, _ = compute_advantages(algo, scores, ids, mask, old, ref, values)
    norm = step_normalizer(mask, algo.aggregation)
    C = float(T)

    w_full = weight0.clone().requires_grad_(True)
    loss, _ = policy_objective(algo, PolicyInputs(logprobs(w_full, slice(None)), old, adv, mask,
                                                  ref))
    full = aggregate_loss(loss, mask, algo.aggregation, constant=C)
    full.backward()

    w_micro = weight0.clone().requires_grad_(True)
    total = 0.0
    for s in range(0, B, size):
        sl = slice(s, s + size)
        loss, _ = policy_objective(algo, PolicyInputs(logprobs(w_micro, sl), old[sl], adv[sl],
                                                      mask[sl], ref[sl]))
        part = aggregate_loss(loss, mask[sl], algo.aggregation, normalizer=norm, constant=C)
        part.backward()
        total += part.item()
    assert w_full.grad.abs().max() > 1e-3
    # float64: both sides add the same ≤ B·T = 192 per-token terms of O(1-10) in another
    # grouping, ≤ 192·u64·Σ|terms| ~ 1e-11, far below 1e-9 and 1e-6; a micro-batch with its
    # own normaliser instead of the step's scales its share of the gradient by the counts'
    # ratio, an O(1) relative error of that share
    assert total == pytest.approx(full.item(), rel=1e-9, abs=1e-9)
    torch.testing.assert_close(w_micro.grad, w_full.grad, rtol=0, atol=1e-6)


def test_reward_kl_without_reference_raises():
    """A reward KL penalty with no reference log-probs is an error, not a silent zero."""
    import pytest
    import torch

    from posttrain.core.algorithms import compute_advantages, get_algorithm

    algo = get_algorithm("reinforce_pp")
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_advantages(algo, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask,
                           torch.zeros(2, 3), None)


def test_record_says_what_the_loop_needs():
    """Per-token rewards, whether zero advantage means zero gradient, Dr. GRPO's constant."""
    from posttrain.core.algorithms import ALGORITHMS, algorithm_names

    assert {n for n, a in ALGORITHMS.items() if a.token_rewards} == {
        "ppo", "reinforce_pp", "reinforce_pp_baseline"}
    assert not ALGORITHMS["grpo"].zero_advantage_zero_gradient  # β > 0: the KL term remains
    assert ALGORITHMS["dapo"].zero_advantage_zero_gradient
    assert ALGORITHMS["grpo"].replace(kl_coef=0.0).zero_advantage_zero_gradient
    assert ALGORITHMS["dr_grpo"].loss_constant(32) == 32.0
    assert ALGORITHMS["grpo"].loss_constant(32) == 1.0
    assert algorithm_names(critic=True) == ["ppo"]
    assert algorithm_names() == list(ALGORITHMS)


@pytest.mark.parametrize("loss_name", sorted(__import__(
    "posttrain.core.algorithms", fromlist=["POLICY_LOSSES"]).POLICY_LOSSES))
def test_declared_zero_advantage_zero_gradient_holds(loss_name):
    """A loss that declares zero advantage → zero gradient gives exactly zero gradient for
    samples whose advantage is 0 on every token, while the other samples' gradient is not
    zero (ratios away from 1, some outside the clip range)."""
    from posttrain.core.algorithms import POLICY_LOSSES

    loss = POLICY_LOSSES[loss_name]
    algo = get_algorithm("gspo" if loss_name.startswith("gspo") else "dapo",
                         policy_loss=loss_name)
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    lp = (old + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    mask = torch.ones(4, 6, dtype=torch.float64)
    adv = torch.tensor([0.0, 1.5, 0.0, -0.7], dtype=torch.float64)
    tok, _ = policy_objective(algo, PolicyInputs(lp, old, adv, mask))
    aggregate_loss(tok, mask, algo.aggregation, step_normalizer(mask, algo.aggregation)
                   ).backward()
    assert loss.zero_advantage_zero_gradient
    assert torch.equal(lp.grad[[0, 2]], torch.zeros(2, 6, dtype=torch.float64))
    assert lp.grad[[1, 3]].abs().sum() > 0 or loss_name.startswith("gspo")


def test_a_loss_without_the_guarantee_turns_skipping_off():
    """The record reads zero_advantage_zero_gradient off the loss's declaration: a loss that
    does not declare it (an entropy bonus, say) is never skipped, whatever β."""
    from posttrain.core import algorithms as A

    bonus = A.PolicyLoss(lambda algo, x: A.POLICY_LOSSES["ppo_clip"].fn(algo, x),
                         zero_advantage_zero_gradient=False)
    saved = dict(A.POLICY_LOSSES)
    try:
        A.POLICY_LOSSES["with_bonus"] = bonus
        algo = get_algorithm("dapo", policy_loss="with_bonus")
        assert algo.kl_coef == 0 and not algo.zero_advantage_zero_gradient
        assert get_algorithm("dapo").zero_advantage_zero_gradient
    finally:
        A.POLICY_LOSSES.clear()
        A.POLICY_LOSSES.update(saved)


def test_declared_inputs_are_checked_with_one_clear_error():
    """An input an algorithm declares and that is None is a ValueError naming it; inputs it
    does not declare may be None."""
    mask = torch.ones(2, 3)
    scores, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages(get_algorithm("ppo", reward_kl_coef=0.0), scores, groups, mask)
    assert get_algorithm("ppo").advantage_inputs >= {"values", "old_logprobs",
                                                     "ref_logprobs"}
    assert "values" not in get_algorithm("grpo").advantage_inputs
    adv, _ = compute_advantages(get_algorithm("grpo"), scores, groups, mask)
    assert adv.shape == (2, 3)
    assert get_algorithm("grpo").loss_inputs >= {"ref_logprobs"}
    assert "ref_logprobs" not in get_algorithm("dapo").loss_inputs


def test_dual_clip_is_validated_by_the_record():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        get_algorithm("grpo", dual_clip=1.0)
    assert get_algorithm("grpo", dual_clip=3.0).dual_clip == 3.0
