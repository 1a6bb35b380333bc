"""The ``hf`` rollout engine: each decode step is the model's own forward over its
``DynamicCache``. Works for every causal LM ``transformers`` runs (sliding windows, soft-capped
heads, mixtures of experts, adapters)."""

from __future__ import annotations

import torch

from posttrain.models import cache_kwarg
from posttrain.rollout.engine import DecodingEngine


class HFDecoder:
    """One decode step through the model's own forward, with its ``DynamicCache``. It keeps
    each row's attention mask and next position."""

    def __init__(self, model, cache, n: int, mask: torch.Tensor, pos: torch.Tensor):
        self.model, self.cache, self.kw = model, cache, cache_kwarg(model)
        cache.batch_repeat_interleave(n)
        self.mask, self.pos = mask, pos  # (N, Lp), (N,)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask, self.pos = self.mask[rows], self.pos[rows]

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tok), 1)], dim=1)
        out = self.model(input_ids=tok[:, None], attention_mask=self.mask,
                         position_ids=self.pos[:, None], use_cache=True,
                         **{self.kw: self.cache})
        self.pos = self.pos + 1
        return out.logits[:, -1]

    def kv(self, slots: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of cache ``slots`` over the first ``columns`` columns,
        ``(layers, len(slots), kv heads, columns, head dim)`` each."""
        layers = self.cache.layers
        return (torch.stack([x.keys[slots, :, :columns] for x in layers]),
                torch.stack([x.values[slots, :, :columns] for x in layers]))

    def activations(self, columns: int, end: torch.Tensor) -> None:
        return None  # nothing is captured on this path


class HFEngine(DecodingEngine):
    """Decode with the model's own forward (any model)."""

    name = "hf"
    extras = frozenset({"head_stats", "routing"})

    def decoder(self, cache, n, max_len, mask, pos, capture):
        return HFDecoder(self.model, cache, n, mask, pos)
