"""Whether a run packs its micro-batches (``--packing``, left automatic), decided once at
start-up from the lengths of the sequences it will train (docs/scaling.md).

A micro-batch's cost in the linear layers, which dominate, is the tokens it runs: a padded
micro-batch runs ``sequences × longest``, a packed one ``rows × longest row``. Packing is
switched on when it would run at most :data:`PACK_BELOW` of the padded tokens on the run's
first micro-batches (drawn in the run's own order). Automatic packing caps a row at the
longest sequence (or pair) of the data, so a packed micro-batch has at most as many rows as
the padded one has sequences and its attention, quadratic in a row's length, never costs
more than the padded one's."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

from posttrain.data import packed_rows

PACK_BELOW = 0.9
"""Pack when the packed micro-batches would run at most this fraction of the padded ones'
tokens. A step's time follows its tokens (a random ~6M Llama, 16 sequences, 2 cores: tokens
1.00 / 0.88 / 0.75 of padded took 0.97 / 0.83 / 0.74 of its time; docs/scaling.md), so
packing pays from small savings; below a tenth the run keeps the padded layout, its
rounding and its slightly smaller memory (1.03× packed at equal tokens)."""

SAMPLED_MICRO_BATCHES = 64
"""How many of the run's first micro-batches the decision reads."""


def layout_tokens(groups: Sequence[Sequence[int]], budget: int | None) -> tuple[int, int]:
    """``(padded, packed)`` tokens of one micro-batch whose sequences have the lengths in
    ``groups`` (a group, a preference pair's two sequences, shares a row), packed as
    :func:`posttrain.data.pack_sequences` packs: in order, a new row when the next group
    would pass ``budget``."""
    lengths = [n for g in groups for n in g]
    sizes = [sum(g) for g in groups]
    rows = packed_rows(sizes, budget)
    return len(lengths) * max(lengths), len(rows) * max(sum(sizes[i] for i in r) for r in rows)


def decide_packing(setting: bool | None, budget: int | None,
                   micro_batches: Sequence[Sequence[Sequence[int]]],
                   longest: int) -> tuple[bool, int | None]:
    """``(packing, budget)`` for a run: ``setting`` with ``budget`` when given; automatic
    (``setting`` None): on when the sampled ``micro_batches`` (each a list of groups of
    sequence lengths) would run at most :data:`PACK_BELOW` of their padded tokens packed,
    rows capped at ``budget`` or else at ``longest``, the data's longest group."""
    if setting is not None:
        return setting, budget
    if not micro_batches:
        return False, budget
    cap = budget if budget is not None else longest
    padded = packed = 0
    for mb in micro_batches:
        a, b = layout_tokens(mb, cap)
        padded, packed = padded + a, packed + b
    return packed <= PACK_BELOW * padded, cap


def decide_for_data(command: str, setting: bool | None, automatic: bool, budget: int | None,
                    groups: Sequence[Sequence[int]], order: Iterator[int], batch_size: int
                    ) -> tuple[bool, int | None]:
    """An offline run's ``(packing, budget)``: :func:`decide_packing` over the first
    :data:`SAMPLED_MICRO_BATCHES` micro-batches of ``batch_size`` examples drawn from
    ``order`` (the run's own; whole micro-batches, so every world decides alike), each
    example's ``groups`` entry the lengths of its sequences. ``automatic``: the user left
    packing unset (``setting`` may still be False: another layout was chosen); the choice
    is then said in one line on the main rank when it packs or a budget goes unused."""
    from posttrain import dist

    micro = [[groups[next(order)] for _ in range(batch_size)]
             for _ in range(SAMPLED_MICRO_BATCHES if groups and setting is None else 0)]
    given = budget is not None
    on, budget = decide_packing(setting, budget, micro, max(map(sum, groups), default=0))
    if automatic and (on or budget is not None) and dist.is_main():
        saves = f"saves at least {1 - PACK_BELOW:.0%} of the tokens"
        print(f"[{command}] packing: " + (
            f"on (automatic: it {saves}), rows of up to {budget} tokens"
            + (", one forward each" if given else "") if on else
            "off (automatic: another layout is used, or packing saves under "
            f"{1 - PACK_BELOW:.0%} of the tokens); max_tokens_per_micro_batch unused"),
            file=sys.stderr, flush=True)
    return on, budget
