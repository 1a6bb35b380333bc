"""The model-agnostic plumbing around Hugging Face models: loading and saving
(:mod:`.loading`), log-probabilities, values and scores at the positions that need them
(:mod:`.logprobs`), and the shared-prompt layouts (:mod:`.shared_prompt`)."""

from posttrain.models.loading import (
    BUILTIN,
    DTYPES,
    ModelError,
    active_parameters,
    backbone,
    builtin_model_dir,
    decoder_layers,
    diagnose,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    moe_experts,
    pick_device,
    resolve,
    save_model,
)
from posttrain.models.logprobs import (
    completion_hidden,
    completion_logprobs,
    has_plain_head,
    head_logits,
    sequence_scores,
    value_head,
)
from posttrain.models.shared_prompt import (
    SHARE_PROMPT_MIN_PARAMS,
    cache_kwarg,
    decide_share_prompt,
    packing_pays,
    packs_shared_prompts,
    shared_prompt_hidden,
    shared_prompt_logprobs,
)

__all__ = [
    "BUILTIN",
    "DTYPES",
    "SHARE_PROMPT_MIN_PARAMS",
    "ModelError",
    "active_parameters",
    "backbone",
    "builtin_model_dir",
    "cache_kwarg",
    "completion_hidden",
    "completion_logprobs",
    "decide_share_prompt",
    "decoder_layers",
    "diagnose",
    "has_plain_head",
    "head_logits",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "moe_experts",
    "packing_pays",
    "packs_shared_prompts",
    "pick_device",
    "resolve",
    "save_model",
    "sequence_scores",
    "shared_prompt_hidden",
    "shared_prompt_logprobs",
    "value_head",
]
