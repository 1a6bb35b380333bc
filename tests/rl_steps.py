"""Driving one RL step of an RLTrainer outside the run loop, with the test's own optimiser."""

from __future__ import annotations

from posttrain.fast.cache import track_policy_version


def rl_step(trainer, opt=None, critic_opt=None) -> dict:
    """The next step's record. ``opt``/``critic_opt`` replace the trainer's AdamW (the policy
    version follows ``opt``'s steps, as it follows the trainer's own)."""
    if opt is not None:
        trainer.optimizers[0].opt = opt
        track_policy_version(trainer.policy, opt)
    if critic_opt is not None:
        trainer.optimizers[1].opt = critic_opt
    return trainer.step(trainer.step_num + 1).values


def check_trainer_reads_behaviour(trainer, rollout, share: bool = False) -> None:
    """The trainer's log-probs of ``rollout``'s sequences at their sampled tokens equal the
    engine's behaviour log-probs to float32 rounding: two float32 forwards of the same
    log-probs differ by at most twice one's rounding bound (relative error norm)."""
    import torch

    from bounds import model_inner, model_stages, rel_bound
    from posttrain.trainers.online import TokenBatch

    mask = rollout.trained_mask.bool()
    sampled = rollout.logprobs[mask].double()
    tokens = TokenBatch(rollout, trainer.tok.pad_token_id, "cpu", share, 1.0)
    with torch.no_grad():
        lp = tokens.logprobs(trainer.policy, torch.arange(len(mask)))[mask].double()
    bound = 2 * rel_bound(model_stages(trainer.policy.config, backward=False),
                          model_inner(trainer.policy.config, 64))
    error = float((lp - sampled).norm() / sampled.norm())
    assert error <= bound, (error, bound)
