"""PPO's critic: where it starts and how it is loaded (a value head on a causal LM, full or
under LoRA, or from a checkpoint)."""

from __future__ import annotations

import logging
from pathlib import Path

from posttrain import fast, sharding
from posttrain.models import load_reward_model, lora, value_head
from posttrain.trainers import loop

log = logging.getLogger(__name__)


def load_critic(cfg, tok, rewards, device, resume: Path | None):
    """The critic: from its checkpoint, or from :func:`critic_source` with a fresh value
    head; with ``critic_lora`` the source's weights frozen under adapters."""
    loop.seed_everything(cfg.seed)  # a fresh value head is drawn from the global RNG
    source = critic_source(cfg, tok, rewards)

    def load(name: str):
        return load_reward_model(name, tok, sharding.load_dtype(
            cfg, device, adapted=bool(cfg.lora_rank and cfg.critic_lora)),
            cfg.device, cfg.trust_remote_code)

    if cfg.critic_lora:  # its base from the source, its adapter and head trained
        base = load(source)
        heads = tuple(n for n, m in base.named_children() if m is value_head(base))
        critic = (lora.load(base, resume / "critic") if resume
                  else lora.add(base, cfg, heads))
    else:
        critic = load(str(resume / "critic") if resume else source)
    critic = fast.prepare_model(critic, cfg.fast)
    value_head(critic)  # fail now, not after the first rollout
    log.info("critic from %s%s", source, " (LoRA)" if cfg.critic_lora else "")
    return critic


def critic_source(cfg, tok, rewards) -> str:
    """Where the critic starts: ``critic_model``; else the reward model when the reward is
    one ``rm:DIR`` term that reads the policy's tokens; else the policy's weights."""
    if getattr(cfg, "critic_model", None):
        return cfg.critic_model
    models = [t.name[3:] for t in rewards if t.name.startswith("rm:")]
    if len(rewards) == 1 and models:
        rm_tok = getattr(rewards[0].fn, "tokenizer", None)
        if rm_tok is not None and rm_tok.get_vocab() != tok.get_vocab():
            log.warning("the reward model %s has another vocabulary than the policy, so it "
                        "cannot read the policy's tokens as a critic; the critic starts "
                        "from the policy (set critic_model to choose)", models[0])
            return cfg.model
        return models[0]
    return cfg.model
