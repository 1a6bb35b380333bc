"""Random response masks shared by the core tests (imported as a plain module: pytest puts
this directory on ``sys.path``)."""

from __future__ import annotations

import torch

SHAPES = [(1, 1), (2, 3), (5, 8), (9, 17)]


def random_mask(B: int, T: int, gen: torch.Generator, holes: bool = False,
                first_row_nonempty: bool = False) -> torch.Tensor:
    """Rows of ``[prompt zeros][response ones][padding zeros]``; one row fully empty when
    ``B > 1``. With ``holes`` some response tokens inside the span are masked too; with
    ``first_row_nonempty`` row 0 always keeps its last token."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        start = int(torch.randint(0, T, (1,), generator=gen))
        length = int(torch.randint(0, T - start + 1, (1,), generator=gen))
        mask[i, start:start + length] = True
    if holes:
        mask &= torch.rand(B, T, generator=gen) > 0.3
    if B > 1:
        mask[B // 2] = False
    if first_row_nonempty:
        mask[0, -1] = True
    return mask
