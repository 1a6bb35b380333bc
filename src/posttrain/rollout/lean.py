"""The ``lean`` rollout engine: decode steps run by ``posttrain.fast.lean``'s decoder (plain
Llama-family models, dense or mixture-of-experts), which can capture the projections' outputs
for the update to replay (dense models) and records the experts it routed to (MoE)."""

from __future__ import annotations

from posttrain.fast.lean import LeanLlamaDecoder
from posttrain.rollout.engine import DecodingEngine


class LeanEngine(DecodingEngine):
    """Decode with :class:`LeanLlamaDecoder`; only for models it supports."""

    name = "lean"
    extras = frozenset({"projections", "head_stats", "routing"})

    @staticmethod
    def supports(model) -> bool:
        return LeanLlamaDecoder.supports(model)

    def __init__(self, model, tokenizer, shares_weights: bool = True):
        if not self.supports(model):
            raise ValueError(f"rollout_backend=lean: {type(model).__name__} is not a plain "
                             "Llama-family model the lean decoder runs; use hf or auto")
        super().__init__(model, tokenizer, shares_weights)

    def decoder(self, cache, n, max_len, mask, pos, capture):
        return LeanLlamaDecoder(self.model, cache, n, max_len, mask, pos, capture)
