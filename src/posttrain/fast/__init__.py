"""Everything that knows a model family or a machine, apart from the model-agnostic code and
behind one switch (``fast``, on by default; each piece also has its own):

- :mod:`.lean` — the lean Llama-family decoder and its capture of projection outputs
  (rollout backend ``lean``);
- :mod:`.cache` — what the sampler computed that the update may reuse (those outputs, the
  head's statistics), as one opaque cache refused once the policy has moved;
- :mod:`.eligibility` — the one decision of what a run keeps (``replay_projections``,
  ``reuse_sampler_head``);
- :mod:`.replay` — the update's forward replaying the projections' outputs;
- :mod:`.attention` — eager attention for short inputs on the CPU;
- :mod:`.memory` — glibc's malloc keeping freed memory (``keep_freed_memory``);
- :mod:`.sparse_rows` — the input embedding trained by rows: sparse gradients, AdamW states
  only for rows that have had one (``sparse_embedding_grad``);
- :mod:`.compile` — ``torch.compile`` of the pointwise blocks (``compile``, off by default).

With ``fast=false`` none of these runs (``compile`` has only its own key); the plain path
(``posttrain.models``, rollout backend ``hf``) never depends on them. (The trainers' AdamW
is ``sparse_rows.AdamW`` either way: with dense gradients it is torch's own step, and it loads
a checkpoint written with row states.)
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def prepare_process(cfg) -> None:
    """Process-wide settings a run applies first: ``keep_freed_memory`` (with ``fast``)."""
    from posttrain.fast.memory import keep_freed_memory

    if getattr(cfg, "fast", True) and cfg.keep_freed_memory and not keep_freed_memory():
        log.info("keep_freed_memory: not available here (needs Linux with glibc)")


def prepare_model(model, enabled: bool = True):
    """Per-model speed-ups of the forward (eager attention for short CPU inputs) when
    ``enabled``; returns the model."""
    if enabled:
        from posttrain.fast.attention import eager_attention_for_short_inputs

        eager_attention_for_short_inputs(model)
    return model
