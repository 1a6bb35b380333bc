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
