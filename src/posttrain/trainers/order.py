"""The order an offline run draws its examples in, rebuilt exactly on resume."""

from __future__ import annotations

import torch


class ExampleStream:
    """Endless shuffled passes over ``n`` examples (seeded): the data order of a run. Its
    state is the count of examples drawn, from which a resumed run rebuilds the same
    order."""

    def __init__(self, n: int, seed: int, drawn: int = 0):
        self.n, self.seed = n, seed
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []
        self.drawn = 0
        for _ in range(drawn // n):
            torch.randperm(n, generator=self.gen)  # the epochs already done
        self.drawn = drawn - drawn % n
        for _ in range(drawn % n):
            next(self)

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if not self.order:
            self.order = torch.randperm(self.n, generator=self.gen).tolist()[::-1]
        self.drawn += 1
        return self.order.pop()
