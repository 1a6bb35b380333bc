"""One rank of tests/test_context_parallel.py (torchrun, gloo): the log-probs, entropies,
hidden states, sequence scores and parameter gradients of float64 models computed with each
sequence split over the ranks, against the same model run whole in this process. Writes the
largest differences, and their scales, as JSON to the path in argv[1] (rank 0)."""

from __future__ import annotations

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from posttrain import dist
from posttrain.models import completion_hidden, completion_logprobs, sequence_scores


def model(cls, heads: int, kv: int, seed: int):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=8,
                      max_position_embeddings=64, pad_token_id=0, num_labels=1,
                      attn_implementation="sdpa")
    return cls(cfg).double()


def batches(gen: torch.Generator):
    """(name, input_ids, attention_mask, position_ids, loss_mask) of every layout."""
    B, T = 3, 13  # 13 columns: padded to 14 over 2 ranks
    ids = torch.randint(1, 61, (B, T), generator=gen)
    loss = torch.zeros(B, T, dtype=torch.long)
    loss[:, 4:] = 1
    right = torch.ones(B, T, dtype=torch.long)
    right[1, 9:] = 0
    right[2, 6:] = 0
    left = torch.ones(B, T, dtype=torch.long)
    left[1, :3] = 0
    left[2, :7] = 0
    yield "whole", ids, None, None, loss
    yield "whole_even", ids[:, :12], None, None, loss[:, :12]
    yield "right_padded", ids, right, None, loss * right
    yield "left_padded", ids, left, None, loss * left
    # packed rows: sequences of 5, 4 and 4 tokens in row 0, 7 and 6 in row 1, one of 13
    pos = torch.tensor([[*range(5), *range(4), *range(4)], [*range(7), *range(6)],
                        list(range(13))])
    packed_loss = (pos >= 2).long()
    yield "packed", ids, None, pos, packed_loss


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init("cpu")
    dist.set_context(2)
    gen = torch.Generator().manual_seed(0)
    report = {}
    for heads, kv in ((4, 4), (4, 2), (4, 1)):
        lm = model(LlamaForCausalLM, heads, kv, seed=1)
        rm = model(LlamaForSequenceClassification, heads, kv, seed=2)
        for name, ids, mask, pos, loss_mask in batches(gen):
            key = f"{heads}h{kv}kv/{name}"
            report[key] = compare(lm, rm, ids, mask, pos, loss_mask, gen)
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(report, f)
    dist.close()


def compare(lm, rm, ids, mask, pos, loss_mask, gen) -> dict:
    w = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=gen, dtype=torch.float64)
    ends = None
    if pos is not None:  # each packed sequence's row and last column
        starts = (pos == 0).nonzero().tolist()
        ends = []
        for i, (r, _) in enumerate(starts):
            nxt = starts[i + 1] if i + 1 < len(starts) else None
            ends.append((r, (nxt[1] if nxt and nxt[0] == r else ids.shape[1]) - 1))
        ends = torch.tensor(ends)

    def run(split: bool):
        for m in (lm, rm):
            m.posttrain_context_parallel = split
            m.zero_grad(set_to_none=True)
        lp, ent = completion_logprobs(lm, ids, mask, loss_mask, with_entropy=True,
                                      position_ids=pos)
        hidden = completion_hidden(lm, ids, mask, loss_mask, position_ids=pos)
        scores = sequence_scores(rm, ids, (mask if mask is not None else torch.ones_like(ids))
                                 if ends is None else None, pos, ends)
        ((lp * w).sum() + hidden.pow(2).sum() * 1e-2 + scores.sum()).backward()
        grads = {f"lm.{k}": p.grad.clone() for k, p in lm.named_parameters()}
        grads.update({f"rm.{k}": p.grad.clone() for k, p in rm.named_parameters()
                      if p.grad is not None})
        if split:  # each rank holds its own columns' part: the group's sum is the gradient
            for g in grads.values():
                torch.distributed.all_reduce(g, group=dist.context_group())
        return {"logprobs": lp.detach(), "entropy": ent, "hidden": hidden.detach(),
                "scores": scores.detach()}, grads

    want, want_g = run(False)
    got, got_g = run(True)
    res = {k: [float((got[k] - want[k]).abs().max()), float(want[k].abs().max())]
           for k in want}
    res["grad"] = [max(float((got_g[k] - want_g[k]).abs().max()) for k in want_g),
                   max(float(g.abs().max()) for g in want_g.values())]
    res["grad_keys"] = sorted(got_g) == sorted(want_g)
    return res


if __name__ == "__main__":
    main(sys.argv[1])
