"""RLHF-PPO in the on-policy loop: a step on the shipped model trains actor and critic, the
critic's gradient does not depend on micro-batching, the two TokenBatch layouts give the same
values, checkpoints resume to the same weights as an uninterrupted run, the optimiser and
running-moment states round-trip, score shaping, the adaptive KL coefficient, where the
critic starts, REINFORCE++ through PPOConfig, and the ``posttrain ppo`` command line."""

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from bounds import assert_within, model_inner, model_stages, pair_bound
from posttrain.core import RunningMoments
from posttrain.trainers.loop.checkpoint import read_optimizer, save_optimizer
from posttrain.trainers.online import PPOConfig, RLTrainer, TokenBatch, run_rl
from posttrain.trainers.online.critic import critic_source
from rl_steps import rl_step

RECORD_KEYS = ("critic/value_loss", "critic/explained_variance", "critic/value_clip_frac",
               "critic/return_mean", "kl/coef", "kl/seq_mean", "train/loss")


def _cfg(model_dir, out, **kw):
    base = dict(model=model_dir, output_dir=str(out), algo="ppo", max_steps=2,
                prompts_per_step=4, group_size=2, minibatch_size=8, micro_batch_size=8,
                max_new_tokens=4, ppo_epochs=2, builtin_train_size=32, builtin_eval_size=8,
                log_every=1, eval_every=0, device="cpu", tensorboard=False)
    base.update(kw)
    cfg = PPOConfig(**base)
    cfg.validate()
    return cfg


def _optimizers(trainer):
    """The two AdamW optimisers exactly as RLTrainer builds them."""
    return [o.opt for o in trainer.optimizers]


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory):
    """Two PPO steps on the shipped model with a checkpoint after step 1 (shared by the
    end-to-end and the resume tests)."""
    out = tmp_path_factory.mktemp("ppo") / "run"
    cfg = _cfg("builtin", out, save_every=1)
    run_rl(cfg)
    return cfg, out


# --- 1. end to end -----------------------------------------------------------------------------

def test_ppo_step_trains_actor_and_critic_on_builtin_model(tmp_path):
    """One step on the shipped model logs finite critic and KL metrics and moves both the
    actor and the critic (head and backbone), never the frozen reference."""
    trainer = RLTrainer(_cfg("builtin", tmp_path))
    assert trainer.critic is not None and trainer.ref is not None
    opt, critic_opt = _optimizers(trainer)
    actor0, critic0, ref0 = (_snapshot(m) for m in (trainer.policy, trainer.critic, trainer.ref))
    record = rl_step(trainer, opt, critic_opt)
    for key in RECORD_KEYS:
        assert key in record, key
        assert math.isfinite(record[key]), (key, record[key])
    assert record["kl/coef"] == pytest.approx(0.05)
    assert record["optim/steps"] == record["critic/optim_steps"] == 2  # 2 epochs × 1 minibatch
    assert record["critic/value_loss"] > 0
    actor1, critic1 = _snapshot(trainer.policy), _snapshot(trainer.critic)
    assert any(not torch.equal(actor0[k], actor1[k]) for k in actor0)
    assert not torch.equal(critic0["score.weight"], critic1["score.weight"])
    assert any(not torch.equal(critic0[k], critic1[k]) for k in critic0 if k.startswith("model."))
    assert all(torch.equal(ref0[k], v) for k, v in trainer.ref.state_dict().items())


def test_run_rl_saves_actor_and_critic_that_transformers_loads(builtin_run):
    """final/ and final/critic/ are Hugging Face directories plain transformers loads with
    no missing weights; the metrics have both steps with the critic's numbers."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    _, out = builtin_run
    _, info = AutoModelForCausalLM.from_pretrained(out / "final", output_loading_info=True)
    assert info["missing_keys"] in ([], set())
    critic, info = AutoModelForSequenceClassification.from_pretrained(
        out / "final" / "critic", output_loading_info=True)
    assert info["missing_keys"] in ([], set())
    assert critic.config.num_labels == 1 and critic.score.weight.shape[0] == 1
    saved = load_file(str(out / "final" / "critic" / "model.safetensors"))
    assert torch.equal(critic.score.weight, saved["score.weight"])
    steps = [r for r in _metrics(out) if "critic/value_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]


# --- 2, 3. the critic's gradient and values ----------------------------------------------------

@pytest.mark.parametrize("share", [False, True])
def test_critic_gradient_independent_of_micro_batching(tiny_model_dir, tmp_path, share):
    """16 samples with the value clip active on some tokens: micro-batches of 16, 4 and 1
    give the same critic gradient."""
    from posttrain.trainers.online.update import accumulate_value_gradient

    trainer = RLTrainer(_cfg(tiny_model_dir, tmp_path, prompts_per_step=4, group_size=4,
                             temperature=1.5))
    critic = trainer.critic.double()
    exp = trainer.experience.collect(1)
    tokens = TokenBatch(exp.rollout, trainer.tok.pad_token_id, "cpu", share)
    n = len(tokens)
    assert n == 16
    mask = tokens.completion_mask.double()
    idx = torch.arange(n)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        values = tokens.values(critic, idx).double()
    # every other token's old value is 0.5 away (beyond ε_v = 0.2), so its clipped term is
    # constant and, where it is the larger, the gradient there is cut
    far = (torch.arange(mask.numel()).view(mask.shape) % 2 == 0)
    sign = torch.where(torch.rand(mask.shape, generator=g) < 0.5, -1.0, 1.0).double()
    old_values = (values + far * sign * 0.5) * mask
    returns = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    live = torch.ones(n, dtype=torch.bool)
    assert trainer.algo.value_clip == pytest.approx(0.2)
    grads, clip_fracs = [], []
    for micro in (n, n // 4, 1):
        critic.zero_grad(set_to_none=True)
        m = accumulate_value_gradient(critic, trainer.algo, tokens, mask, idx, old_values,
                                      returns, live, torch.arange(n), micro)
        clip_fracs.append(m["value_clip_frac"])
        grads.append(torch.cat([(p.grad.to_dense() if p.grad.is_sparse else p.grad).flatten()
                                for p in critic.parameters()]))
    assert 0 < clip_fracs[0] < 1, clip_fracs  # the clip is active, not everywhere
    assert clip_fracs[1] == pytest.approx(clip_fracs[0]) == pytest.approx(clip_fracs[2])
    assert grads[0].abs().max() > 0
    # float64 (the critic above): rounding differs at ~1e-13 of the terms, so these stay
    # loose and exact in effect; any kernel's rounding is 1e6x below them
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-5, atol=1e-6)


def test_values_shared_prompt_equal_full_sequences(tiny_model_dir, tmp_path):
    """TokenBatch.values gives the same V(x, y_<t) with each group's prompt run once as with
    full sequences, for all rows and for a subset that splits groups; 0 under the mask."""
    trainer = RLTrainer(_cfg(tiny_model_dir, tmp_path, prompts_per_step=4, group_size=4,
                             temperature=1.5))
    exp = trainer.experience.collect(1)
    shared = TokenBatch(exp.rollout, trainer.tok.pad_token_id, "cpu", True)
    full = TokenBatch(exp.rollout, trainer.tok.pad_token_id, "cpu", False)
    # two float32 forwards of the critic in two layouts, its head w·h the last reduction:
    # the terms' size is ||w||·||h|| (an error in h, relative to ||h||, reaches the value
    # through ||w||); a 1% error in a value is far beyond it
    critic, ids = trainer.critic, full.full["input_ids"]
    bound = pair_bound(model_stages(critic.config, False), model_inner(critic.config,
                                                                        ids.numel()))
    with torch.no_grad():
        h = critic.model(input_ids=ids, attention_mask=full.full["attention_mask"])[0]
    scale = float(critic.score.weight.norm()) * float(h.norm(dim=-1).max())
    for rows in (torch.arange(len(full)), torch.tensor([1, 2, 7, 9, 15])):
        with torch.no_grad():
            a = shared.values(trainer.critic, rows)
            b = full.values(trainer.critic, rows)
        assert a.shape == b.shape == full.completion_mask[rows].shape
        assert_within(a, b, bound, scale, "values")
        assert (a[full.completion_mask[rows] == 0] == 0).all()
        assert (a[full.completion_mask[rows] == 1] != 0).any()


# --- 4. checkpoints and resume -----------------------------------------------------------------

def test_resume_from_checkpoint_equals_uninterrupted_run(builtin_run, tmp_path):
    """checkpoint-1/ holds actor, critic, both optimiser states and the loop state; resuming
    from it ends on the same actor and critic weights (and step-2 metrics) as the run that
    was not interrupted."""
    _, out = builtin_run
    ckpt = out / "checkpoint-1"
    for name in ("model.safetensors", "critic/model.safetensors",
                 "optimizer-policy.safetensors", "optimizer-policy.json",
                 "optimizer-critic.safetensors", "optimizer-critic.json",
                 "trainer_state.json", "state.safetensors"):
        assert (ckpt / name).is_file(), name
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["job"]["kl_coef"] == pytest.approx(0.05)
    assert not (out / "checkpoint-2").exists()  # the last step is final/, not a checkpoint

    resumed = tmp_path / "resumed"
    run_rl(_cfg("builtin", resumed, resume_from=str(ckpt), save_every=1))
    for sub in ("final", "final/critic"):
        a = load_file(str(out / sub / "model.safetensors"))
        b = load_file(str(resumed / sub / "model.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (sub, k, float((a[k] - b[k]).abs().max()))
    step2 = next(r for r in _metrics(out) if r["step"] == 2 and "reward/mean" in r)
    again = next(r for r in _metrics(resumed) if r["step"] == 2 and "reward/mean" in r)
    assert [r["step"] for r in _metrics(resumed) if "reward/mean" in r] == [2]
    for k, v in step2.items():
        if not k.startswith("time/"):
            assert again[k] == v, k


def test_resume_from_a_directory_without_state_fails(tmp_path):
    """resume_from a directory that is not a checkpoint raises FileNotFoundError naming it."""
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    with pytest.raises((FileNotFoundError, ValueError), match="not-a-checkpoint"):
        RLTrainer(_cfg("builtin", tmp_path / "out", resume_from=str(empty)))


def test_optimizer_round_trip_fused_adamw(tmp_path):
    """save_optimizer/read_optimizer restore a fused AdamW after two steps: the same state
    tensors and hyper-parameters, and the next step lands on the same parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def step(m, o):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()

    step(model, opt)
    step(model, opt)
    save_optimizer(opt.state_dict(), tmp_path / "optimizer")
    assert (tmp_path / "optimizer.safetensors").is_file()
    assert (tmp_path / "optimizer.json").is_file()
    twin = copy.deepcopy(model)
    opt2 = torch.optim.AdamW(twin.parameters(), lr=0.5, weight_decay=0.0, fused=True)
    opt2.load_state_dict(read_optimizer(tmp_path / "optimizer"))
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["state"].keys() == b["state"].keys() and len(a["state"]) == 4
    for pid in a["state"]:
        assert a["state"][pid].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for k, v in a["state"][pid].items():
            assert torch.equal(v, b["state"][pid][k]), (pid, k)
            assert v.dtype == b["state"][pid][k].dtype
    assert float(b["state"][0]["step"]) == 2
    # JSON turns the betas tuple into a list; everything else is the same
    assert json.loads(json.dumps(a["param_groups"])) == b["param_groups"]
    assert b["param_groups"][0]["lr"] == 1e-2 and b["param_groups"][0]["fused"] is True
    step(model, opt)
    step(twin, opt2)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


# --- 6, 7. running moments and score shaping ---------------------------------------------------

def test_running_moments_match_float64_of_finite_values():
    """Chunked updates (with NaN/inf ignored, an all-NaN chunk a no-op) give the float64
    mean and unbiased std of every finite value; normalize and state_dict round-trip."""
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, generator=g) * 3 + 7 for n in (5, 1, 17, 3)]
    chunks[2][[0, 4, 9]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    chunks.append(torch.full((4,), float("nan")))
    rm = RunningMoments()
    assert rm.std == 1.0 and rm.count == 0
    for c in chunks:
        assert c.dtype == torch.float32
        rm.update(c)
    finite = torch.cat([c[torch.isfinite(c)] for c in chunks]).double()
    assert rm.count == finite.numel() == 23
    assert rm.mean == pytest.approx(float(finite.mean()), rel=1e-12)
    assert rm.std == pytest.approx(float(finite.std(unbiased=True)), rel=1e-12)
    x = torch.tensor([7.0, 10.0, -1.0], dtype=torch.float64)
    torch.testing.assert_close(rm.normalize(x), (x - finite.mean()) / finite.std(),
                               rtol=1e-12, atol=1e-12)
    twin = RunningMoments()
    twin.load_state_dict(json.loads(json.dumps(rm.state_dict())))
    assert (twin.count, twin.mean, twin.std) == (rm.count, rm.mean, rm.std)
    more = torch.randn(6, generator=g)
    rm.update(more)
    twin.update(more)
    assert twin.state_dict() == rm.state_dict()
    one = RunningMoments()
    one.update(torch.tensor([5.0]))
    assert (one.mean, one.std) == (5.0, 1.0)  # one value: no spread yet, std 1


def test_shape_scores_penalty_normalisation_and_clip():
    """The missing-EOS penalty hits only truncated samples; normalisation uses the running
    moments of every valid score so far (two calls); the clip bounds the result."""
    from posttrain.trainers.online.shaping import ScoreShaper

    cfg = SimpleNamespace(missing_eos_penalty=0.0, reward_normalize=False, reward_clip=0.0)
    shaper = ScoreShaper(cfg)
    ro = SimpleNamespace(truncated=torch.tensor([True, False, False, True]))
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    valid = torch.ones(4, dtype=torch.bool)

    torch.testing.assert_close(shaper(scores, ro, valid), scores)
    cfg.missing_eos_penalty = 0.5
    torch.testing.assert_close(shaper(scores, ro, valid),
                               torch.tensor([0.5, 2.0, 3.0, 3.5]))
    assert shaper.moments.count == 0  # no normalisation asked: moments untouched

    cfg.missing_eos_penalty = 0.0
    cfg.reward_normalize = True
    first = shaper(scores, ro, valid)
    torch.testing.assert_close(first, (scores - 2.5) / scores.std())
    second_in = torch.tensor([10.0, -2.0, 0.0, 5.0])
    second_valid = torch.tensor([True, True, False, True])  # 0.0 is a skipped sample
    second = shaper(second_in, ro, second_valid)
    seen = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, -2.0, 5.0], dtype=torch.float64)
    assert shaper.moments.count == 7
    expected = ((second_in.double() - seen.mean()) / seen.std()).float()
    torch.testing.assert_close(second, expected)

    cfg.reward_clip = 0.5
    clipped = shaper(second_in, ro, torch.zeros(4, dtype=torch.bool))
    assert shaper.moments.count == 7  # nothing valid: moments unchanged
    torch.testing.assert_close(clipped, expected.clamp(-0.5, 0.5))
    assert clipped.abs().max() == 0.5 and (clipped.abs() < 0.5).any()


# --- 8. adaptive KL ----------------------------------------------------------------------------

def test_adaptive_kl_coefficient_follows_the_controller(tiny_model_dir, tmp_path):
    """With kl_target set, k moves after each step by Ziegler et al.'s rule (down after step
    1, whose KL is 0 since the policy is the reference); with kl_target 0 it stays put."""
    target, horizon = 0.001, 100.0
    trainer = RLTrainer(_cfg(tiny_model_dir, tmp_path / "adaptive", reward_kl_coef=0.05,
                             kl_target=target, kl_horizon=horizon, temperature=1.5))
    opt, critic_opt = _optimizers(trainer)
    r1 = rl_step(trainer, opt, critic_opt)
    r2 = rl_step(trainer, opt, critic_opt)
    n = 4 * 2  # samples per step

    def moved(k, kl):
        return k * (1 + min(max(kl / target - 1, -0.2), 0.2) * n / horizon)

    assert r1["kl/coef"] == pytest.approx(0.05)
    assert r1["kl/seq_mean"] == 0.0
    assert r2["kl/coef"] < r1["kl/coef"]
    assert r2["kl/coef"] == pytest.approx(moved(0.05, 0.0), rel=1e-12)
    assert r2["kl/seq_mean"] != 0  # the policy moved (k1 may come out negative)
    assert trainer.kl_ctl.value == pytest.approx(moved(r2["kl/coef"], r2["kl/seq_mean"]),
                                                 rel=1e-12)

    fixed = RLTrainer(_cfg(tiny_model_dir, tmp_path / "fixed", reward_kl_coef=0.05,
                           temperature=1.5))
    opt, critic_opt = _optimizers(fixed)
    f1, f2 = rl_step(fixed, opt, critic_opt), rl_step(fixed, opt, critic_opt)
    assert f1["kl/coef"] == f2["kl/coef"] == fixed.kl_ctl.value == 0.05
    assert f2["kl/seq_mean"] != 0  # there was KL to react to


# --- 9. where the critic starts ----------------------------------------------------------------

def _reward_model_dir(model_dir, path, seed):
    from posttrain.models import load_reward_model, load_tokenizer, save_model

    tok = load_tokenizer(model_dir)
    torch.manual_seed(seed)
    rm = load_reward_model(model_dir, tok, device="cpu")
    if seed:  # make the backbone distinguishable too
        with torch.no_grad():
            rm.model.norm.weight.add_(float(seed))
    save_model(rm, tok, path)
    return load_file(str(path / "model.safetensors"))


def test_critic_starts_from_reward_model_critic_model_or_policy(tiny_model_dir, tmp_path):
    """reward rm:DIR alone → the critic is that reward model (score head included);
    critic_model → that directory; otherwise the policy's backbone with a fresh head."""
    rm_dir, other_dir = tmp_path / "rm", tmp_path / "other"
    rm = _reward_model_dir(tiny_model_dir, rm_dir, 7)
    other = _reward_model_dir(tiny_model_dir, other_dir, 3)
    assert not torch.equal(rm["score.weight"], other["score.weight"])

    from_rm = RLTrainer(_cfg(tiny_model_dir, tmp_path / "a", reward=f"rm:{rm_dir}"))
    assert critic_source(from_rm.cfg, from_rm.tok, from_rm.rewards) == str(rm_dir)
    for k, v in from_rm.critic.state_dict().items():
        assert torch.equal(v, rm[k]), k

    explicit = RLTrainer(_cfg(tiny_model_dir, tmp_path / "b", reward=f"rm:{rm_dir}",
                              critic_model=str(other_dir)))
    assert critic_source(explicit.cfg, explicit.tok, explicit.rewards) == str(other_dir)
    for k, v in explicit.critic.state_dict().items():
        assert torch.equal(v, other[k]), k

    for reward in ("builtin", f"rm:{rm_dir},builtin"):  # not a single rm: term
        fresh = RLTrainer(_cfg(tiny_model_dir, tmp_path / "c", reward=reward))
        assert critic_source(fresh.cfg, fresh.tok, fresh.rewards) == tiny_model_dir
        actor = fresh.policy.state_dict()
        critic = fresh.critic.state_dict()
        backbone = [k for k in critic if k != "score.weight"]
        assert backbone and all(torch.equal(critic[k], actor[k]) for k in backbone)
        assert not torch.equal(critic["score.weight"], rm["score.weight"])


def test_critic_warmup_trains_the_critic_alone(tiny_model_dir, tmp_path):
    """During critic_warmup_steps only the critic moves; afterwards both do."""
    trainer = RLTrainer(_cfg(tiny_model_dir, tmp_path, critic_warmup_steps=1, temperature=1.5))
    opt, critic_opt = _optimizers(trainer)
    actor0, critic0 = _snapshot(trainer.policy), _snapshot(trainer.critic)
    record = rl_step(trainer, opt, critic_opt)
    assert record["optim/steps"] == 0 and record["critic/optim_steps"] > 0
    assert all(torch.equal(v, actor0[k]) for k, v in trainer.policy.state_dict().items())
    assert any(not torch.equal(v, critic0[k]) for k, v in trainer.critic.state_dict().items())
    record = rl_step(trainer, opt, critic_opt)
    assert record["optim/steps"] > 0
    assert any(not torch.equal(v, actor0[k]) for k, v in trainer.policy.state_dict().items())


def test_fresh_value_head_follows_the_seed(tiny_model_dir, tmp_path):
    """The fresh critic head is drawn after seeding: the same seed gives the same head in one
    process (whatever ran before), another seed another head."""
    heads = []
    for seed in (0, 0, 1):
        torch.manual_seed(1234 + len(heads))  # disturb the global generator
        trainer = RLTrainer(_cfg(tiny_model_dir, tmp_path / str(len(heads)), seed=seed))
        heads.append(trainer.critic.score.weight.detach().clone())
    assert torch.equal(heads[0], heads[1])
    assert not torch.equal(heads[0], heads[2])


# --- 10. REINFORCE++ through PPOConfig ---------------------------------------------------------

@pytest.mark.parametrize("algo", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_runs_with_one_epoch_and_no_critic(tiny_model_dir, tmp_path, algo):
    """With ppo_epochs=1 the old log-probs are still computed for the KL in the reward (they
    were not, and the step failed); there is no critic, in memory, metrics or on disk."""
    reward = tmp_path / "r.py"  # a reward with signal, so the policy moves
    reward.write_text("def chars(prompts, completions, **_):\n"
                      "    return [float(sum(map(ord, c)) % 5) for c in completions]\n")
    trainer = RLTrainer(_cfg(tiny_model_dir, tmp_path, algo=algo, ppo_epochs=1,
                             reward=f"{reward}:chars", temperature=1.5))
    assert trainer.critic is None and trainer.ref is not None
    trainer.train()
    steps = [r for r in _metrics(tmp_path) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["kl/seq_mean"]) and r["kl/coef"] == pytest.approx(0.01)
        assert math.isfinite(r["train/loss"])
        assert r["optim/steps"] == 1 and r["samples/backward_frac"] > 0
        assert not any(k.startswith("critic/") for k in r)
    assert steps[0]["kl/seq_mean"] == 0 and steps[1]["kl/seq_mean"] != 0
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert not (tmp_path / "final" / "critic").exists()


# --- 11. command line --------------------------------------------------------------------------

def test_cli_ppo_runs_rejects_grpo_and_documents_critic_lr(tiny_model_dir, tmp_path, capsys):
    """posttrain ppo trains and exits 0; --algo grpo exits 2 naming the allowed algorithms;
    --help lists the critic's keys."""
    from posttrain.cli import main

    out = tmp_path / "cli"
    argv = ["ppo", "--max_steps", "1", "--model", tiny_model_dir, "--prompts_per_step", "2",
            "--group_size", "2", "--max_new_tokens", "4", "--minibatch_size", "4",
            "--micro_batch_size", "4", "--builtin_train_size", "8", "--builtin_eval_size", "4",
            "--device", "cpu", "--tensorboard", "false", "--output_dir", str(out)]
    assert main(argv) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["output_dir"] == str(out)
    assert (out / "final" / "critic" / "model.safetensors").is_file()
    assert "critic/value_loss" in next(r for r in _metrics(out) if r["step"] == 1
                                       and "reward/mean" in r)

    assert main(["ppo", "--algo", "grpo"]) == 2
    err = capsys.readouterr().err
    assert "ppo, reinforce_pp, reinforce_pp_baseline" in err

    with pytest.raises(SystemExit) as e:
        main(["ppo", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for key in ("--critic_lr", "--critic_model", "--value_clip", "--kl_target"):
        assert key in help_text, key


# --- config corners -----------------------------------------------------------------------------

def test_value_clip_zero_means_unclipped():
    """value_clip: 0 turns the value clip off (ε_v None); unset keeps the table's 0.2."""
    cfg = PPOConfig(value_clip=0.0)
    cfg.validate()
    assert cfg.algorithm().value_clip is None
    assert PPOConfig().algorithm().value_clip == pytest.approx(0.2)
    assert PPOConfig(value_clip=0.1).algorithm().value_clip == pytest.approx(0.1)


@pytest.mark.parametrize("kw, match", [
    (dict(algo="reinforce_pp", critic_warmup_steps=2), "critic_warmup_steps needs a critic"),
    (dict(value_clip=-0.1), "value_clip must be"),
    (dict(value_coef=0.0), "value_coef > 0"),
    (dict(gamma=1.5), "gamma and lam"),
    (dict(kl_target=1.0, reward_kl_coef=0.0), "kl_target needs"),
])
def test_ppo_config_rejects(kw, match):
    """Settings that would silently do nothing or the wrong thing are errors."""
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        PPOConfig(**kw).validate()


def test_critic_not_from_a_reward_model_with_another_vocabulary(tiny_model_dir, tmp_path,
                                                                caplog):
    """A reward model whose tokenizer differs from the policy's cannot read the policy's
    token ids, so the critic starts from the policy instead, with a warning."""
    from posttrain.models import load_reward_model, load_tokenizer, save_model

    tok = load_tokenizer(tiny_model_dir)
    rm = load_reward_model(tiny_model_dir, tok, device="cpu")
    tok.add_tokens(["<extra>"])  # a different vocabulary
    save_model(rm, tok, tmp_path / "rm")
    with caplog.at_level("WARNING"):
        trainer = RLTrainer(_cfg(tiny_model_dir, tmp_path / "run", reward=f"rm:{tmp_path}/rm"))
    assert critic_source(trainer.cfg, trainer.tok, trainer.rewards) == tiny_model_dir
    assert "another vocabulary" in caplog.text
