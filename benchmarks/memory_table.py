"""The memory each parallel mode needs per GPU for GRPO on a 1.5B and a 7B model, computed
(nothing is allocated: the models are built on the meta device).

    python benchmarks/memory_table.py [--gpus 8] [--rows 8] [--tokens 1024]

Counted per GPU:

- **weights, gradients, AdamW states** of the trained policy: bf16 everything under ddp
  with ``--dtype bfloat16`` (2 + 2 + 4 bytes a parameter), and under fsdp float32 masters,
  gradients and states (4 + 4 + 8) divided over the GPUs, plus two decoder layers gathered
  in bf16 (the one computing and the next one being fetched);
- **the frozen reference** in bf16, whole on every GPU in both modes, and under fsdp the
  **sampler's copy** of the policy in bf16 (refreshed from the shards once per RL step);
- **activations** of one micro-batch of ``--rows`` sequences of ``--tokens`` tokens in
  bf16, without activation checkpointing: the tensors autograd saves in the backbone's
  forward (measured on the meta device, each stored tensor counted once; attention as a
  fused kernel keeps it: q, k, v, output, log-sum-exp), plus the
  head's ``rows × tokens × vocabulary`` float32 log-softmax that the log-prob pass keeps
  for its backward.

Not counted: the CUDA context and allocator slack (about 1–2 GB), the sampling KV cache
(small next to these at this batch), temporaries of the optimiser step.
"""

from __future__ import annotations

import argparse

import torch

# public configurations of Qwen2.5-1.5B and Qwen2.5-7B (their config.json values)
MODELS = {
    "1.5B (Qwen2.5-1.5B shape)": dict(hidden_size=1536, intermediate_size=8960,
                                      num_hidden_layers=28, num_attention_heads=12,
                                      num_key_value_heads=2, vocab_size=151936,
                                      tie_word_embeddings=True),
    "7B (Qwen2.5-7B shape)": dict(hidden_size=3584, intermediate_size=18944,
                                  num_hidden_layers=28, num_attention_heads=28,
                                  num_key_value_heads=4, vocab_size=152064,
                                  tie_word_embeddings=False),
}
GB = 1e9


class _FlashLike(torch.autograd.Function):
    """What a fused attention kernel (flash / memory-efficient SDPA on a GPU) keeps for its
    backward: q, k, v, the output and the row log-sum-exp, never the T × T weights."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out


def _attention(module, query, key, value, attention_mask, **kwargs):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return _FlashLike.apply(query, key, value).transpose(1, 2), None


def build(shape: dict):
    from transformers import AttentionInterface, AutoModelForCausalLM, Qwen2Config

    AttentionInterface.register("posttrain_meta_fused", _attention)
    cfg = Qwen2Config(**shape, max_position_embeddings=32768)
    cfg._attn_implementation = "posttrain_meta_fused"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def saved_activation_bytes(model, rows: int, tokens: int) -> int:
    """Bytes of the distinct tensors autograd saves in the backbone's forward."""
    seen: dict[int, int] = {}
    keep = []

    def pack(t):
        base = t._base if t._base is not None else t
        keep.append(base)  # alive, so ids are not reused
        seen[id(base)] = base.numel() * base.element_size()
        return t

    for p in model.parameters():
        p.requires_grad_(True)
    ids = torch.zeros(rows, tokens, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids)
    params = {id(p) for p in model.parameters()}
    return sum(b for i, b in seen.items() if i not in params)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    args = p.parse_args()
    n = args.gpus
    print(f"GRPO per GPU, micro-batch {args.rows} × {args.tokens} tokens, bf16 compute, "
          f"fsdp over {n} GPUs; GB = 1e9 bytes\n")
    print("| model | mode | policy weights + grads + AdamW | reference | sampler copy | "
          "activations | total |")
    print("|---|---|---|---|---|---|---|")
    for name, shape in MODELS.items():
        model = build(shape)
        P = sum(x.numel() for x in model.parameters())
        layer = sum(x.numel() for x in model.model.layers[0].parameters())
        acts = saved_activation_bytes(model, args.rows, args.tokens)
        acts += args.rows * args.tokens * shape["vocab_size"] * 4
        ref = 2 * P
        modes = {
            "one GPU / ddp (bf16)": (8 * P, ref, 0),
            f"fsdp × {n}": (16 * P / n + 2 * 2 * layer, ref, 2 * P),
            f"fsdp × {n} + cpu_offload": (2 * 2 * layer, ref, 2 * P),
        }
        for mode, (policy, r, sampler) in modes.items():
            total = policy + r + sampler + acts
            print(f"| {name}, {P / 1e9:.2f}B params | {mode} | {policy / GB:.1f} | "
                  f"{r / GB:.1f} | {sampler / GB:.1f} | {acts / GB:.1f} | "
                  f"**{total / GB:.1f}** |")
    print(f"\n(cpu_offload moves {16 / n:.1f} bytes a parameter per rank to host memory.)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
