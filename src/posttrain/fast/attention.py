"""Eager attention for short inputs on the CPU: a forward pre-hook that switches a model
between its eager and SDPA attention per call, by key length."""

from __future__ import annotations

import types

from transformers import PreTrainedModel

from posttrain.models import backbone, cache_kwarg
from posttrain.models.context_parallel import NAME as CONTEXT_PARALLEL

# On the CPU, for a short key length the model's eager attention (two matmuls and a softmax)
# is faster than SDPA's CPU kernel, whose fixed cost per call dominates there; for long ones
# SDPA wins and eager's L×L scores cost memory. The crossover, forward and backward, lies
# between 128 and 256 keys on 2 cores (docs/benchmarks.md, CPU speed switches).
EAGER_ATTENTION_MAX_KEYS = 128

def attention_for_keys(model: PreTrainedModel, keys: int) -> str:
    """Set (and return) the attention implementation a forward over ``keys`` key positions
    uses on a model prepared by :func:`eager_attention_for_short_inputs`: ``eager`` up to
    :data:`EAGER_ATTENTION_MAX_KEYS` while the model is on the CPU, else ``sdpa``. Other
    models are left as they are."""
    if not getattr(model, "_posttrain_short_eager", False) \
            or model.config._attn_implementation == CONTEXT_PARALLEL:  # a split forward's own
        return model.config._attn_implementation
    on_cpu = next(model.parameters()).device.type == "cpu"  # it may have moved since
    impl = "eager" if on_cpu and keys <= EAGER_ATTENTION_MAX_KEYS else "sdpa"
    if model.config._attn_implementation != impl:
        model.set_attn_implementation(impl)
    return impl

def _pick(model, module, args, kwargs) -> None:
    """The pre-hook: the implementation for this call's key length (cached + new)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is None:
        return
    cache = kwargs.get(model._posttrain_cache_kwarg, kwargs.get("past_key_values"))
    past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
    attention_for_keys(model, past + ids.shape[1])


def eager_attention_for_short_inputs(model: PreTrainedModel) -> bool:
    """On the CPU, have a model that uses SDPA attention switch to its eager attention for
    every forward call whose key length (cached positions + new ones) is at most
    :data:`EAGER_ATTENTION_MAX_KEYS`, and back for longer ones: a forward pre-hook on its
    base model decides per call. The two compute the same attention (equal to float
    rounding, tested). Returns whether the hook was installed (CPU, SDPA, a ``transformers``
    that can switch)."""
    try:
        base = backbone(model)
    except ValueError:
        base = None
    if (next(model.parameters()).device.type != "cpu" or base is None
            or getattr(model.config, "_attn_implementation", None) != "sdpa"
            or not hasattr(model, "set_attn_implementation")
            or getattr(model, "_posttrain_short_eager", False)):
        return False
    model._posttrain_short_eager = True
    model._posttrain_cache_kwarg = cache_kwarg(base)
    # the shared-prompt layouts build their mask for the implementation a call will use
    model.posttrain_attention_for_keys = types.MethodType(attention_for_keys, model)
    # a method of the model, not a closure over it: a deep copy of the model (a sampler's
    # own copy) then switches its own attention, not the original's
    base.register_forward_pre_hook(types.MethodType(_pick, model), with_kwargs=True)
    return True
