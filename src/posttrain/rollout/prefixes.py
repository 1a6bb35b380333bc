"""What a :class:`~posttrain.rollout.engine.DecodingEngine` keeps of its samples inside
``reusing_prefixes()``: each sequence it produced (prompt and completion, less the last
token, which was never fed) with its keys and values, so that a later request extending it
(an episode's next turn, an agent's next request) runs only what it adds."""

from __future__ import annotations

import torch

KV = tuple[torch.Tensor, torch.Tensor]


class Prefixes:
    """The held sequences and their keys and values. A held sequence is released after the
    call in which a request extended it (its extension is held instead: episodes whose
    turns come together), or, when ``managed``, only by :meth:`retain` (requests that come
    one at a time, an agent's: two episodes may hold the same sequence); else when the
    block ends."""

    def __init__(self, on: bool = False, managed: bool = False):
        self.on, self.managed = on, managed
        self.held: dict[tuple[int, ...], KV] = {}
        self._extended: set[tuple[int, ...]] = set()

    def _longest(self, ids, lengths, left: int = 1) -> tuple[int, ...] | None:
        """The longest held prefix of ``ids`` that leaves at least ``left`` tokens (one to
        run, for a prompt)."""
        return next((tuple(ids[:n]) for n in lengths
                     if n <= len(ids) - left and tuple(ids[:n]) in self.held), None)

    def find(self, prompt_ids: list[list[int]]) -> list[KV | None] | None:
        """Per prompt, the keys and values of its longest held prefix, or None (None for
        all: nothing held fits)."""
        if not self.on or not self.held:
            return None
        lengths = sorted({len(k) for k in self.held}, reverse=True)
        out = []
        for p in prompt_ids:
            key = self._longest(p, lengths)
            out.append(None if key is None else self.held[key])
            if key is not None and not self.managed:  # (released after this call)
                self._extended.add(key)
        return out if any(x is not None for x in out) else None

    def settle(self, held: dict[tuple[int, ...], KV]) -> None:
        """After a call: what it extended released, what it produced (``held``) kept."""
        for key in self._extended:
            self.held.pop(key, None)
        self._extended = set()
        self.held.update(held)

    def retain(self, sequences) -> None:
        """Keep only what is a prefix of one of ``sequences`` (the requests that may still
        come: what nothing can extend any more is released now, not at the block's end)."""
        lengths = sorted({len(k) for k in self.held}, reverse=True)
        keep = {self._longest(s, lengths, left=0) for s in sequences}
        self.held = {k: v for k, v in self.held.items() if k in keep}
