"""What a run trains: the model loaded (fully trained, or its base with LoRA adapters), sharded
under ``parallel=fsdp``, and gathered whole for a save. The trainers call these in this
order: :func:`load_trained` (with :func:`load_policy` or a reward-model loader), then
:func:`shard_trained` before the optimiser is made; the run loop calls
:func:`full_states` before it writes."""

from __future__ import annotations

from pathlib import Path

from posttrain import fast, sharding
from posttrain.config import ConfigError


def full_states(job) -> dict[str, dict | None]:
    """The full state dict of each sharded model of ``job`` by name (rank 0; None on the
    other ranks); nothing for the others. Collective: every rank calls it."""
    return {name: sharding.full_state(m) for name, m in job.models().items()
            if sharding.is_sharded(m)}


def load_policy(cfg, name: str, trained: bool = False):
    """A causal LM ``name`` on ``cfg``'s device and dtype, with the forward speed-ups of
    ``posttrain.fast`` when ``cfg.fast``. ``trained``: the model the run trains (in FSDP's
    master dtype under ``parallel=fsdp``; not yet sharded, see :func:`shard_trained`)."""
    from posttrain.models import load_causal_lm, pick_device

    dtype = sharding.load_dtype(cfg, pick_device(cfg.device)) if trained else cfg.dtype
    return fast.prepare_model(load_causal_lm(name, dtype, cfg.device, cfg.trust_remote_code),
                              cfg.fast)


def load_trained(cfg, resume: Path | None, load, heads: tuple[str, ...] = ()):
    """The model the run trains. Full fine-tuning: ``load(name)`` of the checkpoint (when
    resuming) or of ``cfg.model``. With ``lora_rank``: the base ``cfg.model`` (4-bit with
    ``load_in_4bit``) with fresh adapters, or the checkpoint's; ``heads`` stay trainable.

    A ``cfg.model`` that is an adapter directory loads merged into its base (``load`` does
    it), so the run starts from exactly base + adapter either way: without ``lora_rank`` it
    trains that merged model in full; with it, a fresh rank-``lora_rank`` adapter on top, so
    the frozen reference (the policy with its adapter off) is that start, as it is for
    full fine-tuning, and not the first adapter's base. QLoRA cannot start from one (its
    4-bit base would round the merged weights): that is one line asking to merge it first."""
    from posttrain.models import lora, pick_device

    if not lora.wanted(cfg):
        return load(str(resume or cfg.model))
    try:
        base = (lora.load_4bit(cfg.model, pick_device(cfg.device), cfg.trust_remote_code)
                if cfg.load_in_4bit else load(cfg.model))
        return lora.load(base, resume) if resume else lora.add(base, cfg, heads)
    except lora.LoRAError as e:
        raise ConfigError(str(e)) from None


def shard_trained(cfg, model):
    """``model`` sharded with FSDP2 under ``parallel=fsdp`` (:mod:`posttrain.sharding`),
    else as it is; before its optimiser is made. Under ``context_parallel`` its training
    forwards split each sequence over the group (:mod:`posttrain.models.context_parallel`)."""
    from posttrain.models import context_parallel

    context_parallel.enable(model)
    return sharding.shard(model, cfg) if cfg.parallel == "fsdp" else model
