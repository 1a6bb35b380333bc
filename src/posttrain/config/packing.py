"""The keys of padding-free packing (``--packing``; docs/scaling.md), one declaration for
every trainer that takes them."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.errors import check


@dataclass
class PackingFields:
    packing: bool | None = None
    """Padding-free micro-batches: a micro-batch's sequences one after another in rows of
    at most max_tokens_per_micro_batch tokens, positions restarting per sequence (the
    model's attention keeps each to itself; a preference pair's two in one row); loss and
    metrics as padded, less the padding's compute and memory. none = automatic: sft, rm
    and dpo pack when packing would save at least a tenth of their first micro-batches'
    tokens (rows capped at the data's longest sequence or pair); the RL trainers decide
    so per step for full sequences (rows capped at the step's longest), and leave the
    shared-prompt layout as it is (docs/scaling.md)."""
    max_tokens_per_micro_batch: int | None = None
    """packing: the token budget of a forward. The step's examples (sft, rm, dpo; this
    rank's share under torchrun), or an RL minibatch's and each scoring pass's sequences,
    are cut in order into packed rows of at most N tokens, one row per forward and
    backward, whatever batch_size or micro_batch_size say; a longer sequence, or pair,
    runs alone. None: a micro-batch is one row, or with automatic packing rows as long as
    the data's longest sequence or pair, a micro-batch's rows in one forward."""

    def _check_packing(self) -> None:
        # (with packing left at none a budget bounds the forwards of the packing decided)
        if self.packing is False:
            self.refuse(("max_tokens_per_micro_batch",), f"{self.COMMAND} with --packing "
                        "false")
        check(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
              "max_tokens_per_micro_batch must be ≥ 1")
        check(not (self.packing and getattr(self, "share_prompt", None)), "packing and "
              "share_prompt are two layouts of the same sequences: choose one")
