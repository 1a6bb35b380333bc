"""LoRA against full fine-tuning for GRPO with a reference (β 0.04): peak resident memory
and step time, on the ~25M model and on a ~180M model with a 151,936-token vocabulary
(hidden 512, 8 layers, untied embeddings: Qwen's vocabulary on a small body).

    python benchmarks/lora_memory.py [--sizes medium large] [--repeats 2] [--steps 6]
        [--rank 16] [--micro_batch_size 128]

Each run is a fresh ``posttrain grpo`` process (8 prompts × 8 completions, 32 new tokens,
fp32, the default fast path), full and LoRA alternating; it prints the median peak RSS and
the median s/step (steps 3 onwards) of each, and their ratios. Full fine-tuning holds the
policy, its gradients, AdamW's two states and a reference copy (≈ 5× the weights); LoRA the
frozen base, the sampler's merged copy and the adapters (≈ 2×).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import SIZES, child_env, scratch, spawn

LARGE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8, vocab_size=151936,
             tie_word_embeddings=False)


def build(size: str, out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.builtin.build import ARCH, build_tokenizer

    tok = build_tokenizer()
    arch = {**ARCH, **(LARGE if size == "large" else {**SIZES[size], "vocab_size": len(tok)})}
    cfg = LlamaConfig(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, **arch)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run(model: Path, lora_rank: int, steps: int, work: Path, micro: int
        ) -> tuple[float, float]:
    out = Path(tempfile.mkdtemp(dir=work))
    cmd = [sys.executable, "-m", "posttrain", "grpo", "--model", str(model),
           "--prompts_per_step", "8", "--group_size", "8", "--max_new_tokens", "32",
           "--kl_coef", "0.04", "--max_steps", str(steps), "--log_every", "1",
           "--builtin_eval_size", "8", "--builtin_train_size", "256", "--device", "cpu",
           "--tensorboard", "false", "--lora_rank", str(lora_rank),
           "--micro_batch_size", str(micro), "--output_dir", str(out)]
    _, err, code, rss = spawn(cmd, child_env())
    if code != 0:
        raise SystemExit(err[-3000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time/step_s"] for r in rows if "time/step_s" in r][2:]
    return rss, statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["medium", "large"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--micro_batch_size", type=int, default=128,
                   help="rows per forward/backward of the update, for both runs (the "
                        "update is the same whatever it is; 128: all 64 samples at once)")
    args = p.parse_args()
    with scratch(None, "posttrain-lora-") as work:
        return _measure(args, work)


def _measure(args, work: Path) -> int:
    print(f"| model | full: peak RSS, s/step | LoRA r={args.rank}: peak RSS, s/step | "
          "RSS ratio | time ratio |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        model = build(size, work / f"model-{size}")
        got: dict[int, list[tuple[float, float]]] = {0: [], args.rank: []}
        for rep in range(args.repeats):
            for r in ((0, args.rank) if rep % 2 == 0 else (args.rank, 0)):
                got[r].append(run(model, r, args.steps, work, args.micro_batch_size))
                print(f"{size} rep {rep} rank {r}: {got[r][-1][0]:.0f} MiB, "
                      f"{got[r][-1][1]:.3f} s/step", file=sys.stderr)
        full = [statistics.median(x[i] for x in got[0]) for i in (0, 1)]
        low = [statistics.median(x[i] for x in got[args.rank]) for i in (0, 1)]
        print(f"| {size} | {full[0]:.0f} MiB, {full[1]:.3f} | {low[0]:.0f} MiB, "
              f"{low[1]:.3f} | {low[0] / full[0]:.2f} | {low[1] / full[1]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
