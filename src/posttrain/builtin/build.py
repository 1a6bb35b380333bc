"""Build the built-in default model from scratch, deterministically.

A tiny Llama (0.85M parameters: hidden 128, 4 layers, 4 heads, tied embeddings) with the
byte-level tokenizer is initialised from a fixed seed and trained with posttrain's own SFT
trainer on the built-in addition task's flawed demonstrations until it plateaus (see
``posttrain.builtin.task``). The result is what ``--model builtin`` loads; this script is how
it was made:

    python -m posttrain.builtin.build [--out DIR] [--steps N]

``--episodes`` builds ``builtin-episodes``, the start of the built-in multi-turn task
(``posttrain.builtin.episodes``): the built-in model SFT'd on that task's ``messages``
demonstrations (every assistant turn trained), ``EPISODES_SFT`` below.

The loss falls in a phase transition between steps 500 and 1000, then creeps to the floor
set by the flawed demonstrations (0.133 nats per completion token). On two CPU cores it
takes about five minutes; the shipped copy (3.4 MB) saves users that time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.builtin import task
from posttrain.builtin.tokenizer import build_tokenizer

ARCH = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True)
SFT = dict(lr=2e-3, batch_size=128, max_steps=2000, warmup_ratio=0.02, lr_schedule="cosine",
           weight_decay=0.01, builtin_train_size=50_000, builtin_eval_size=1000,
           log_every=100, eval_every=500, max_length=32, seed=0)


EPISODES_SFT = dict(lr=1e-3, batch_size=64, max_steps=1200, warmup_ratio=0.05,
                    lr_schedule="cosine", log_every=50, max_length=64, seed=0)
EPISODES_ROWS = 20_000


def build_episodes(out: Path, work: Path, steps: int) -> dict:
    """``builtin-episodes``: the built-in model SFT'd on the multi-turn demonstrations."""
    from posttrain.builtin import episodes
    from posttrain.trainers.offline import SFTConfig, run_sft

    work.mkdir(parents=True, exist_ok=True)
    data = work / "episodes_sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in episodes.sft_rows(EPISODES_ROWS)))
    cfg = SFTConfig(model="builtin", data=str(data), output_dir=str(work / "sft-episodes"),
                    device="cpu", **{**EPISODES_SFT, "max_steps": steps})
    cfg.validate()
    metrics = run_sft(cfg)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(work / "sft-episodes" / "final", out)
    (out / "manifest.json").unlink(missing_ok=True)  # the run's record, not the model's
    return {"train_loss": metrics.get("train/loss")}


def init_model(out: Path, seed: int = 0, **arch) -> None:
    tok = build_tokenizer()
    # ``arch`` may widen the vocabulary past the tokenizer's (a benchmark of a
    # 151,936-token head); the ids beyond it are never produced by the tokenizer
    cfg = LlamaConfig(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id,
                      **{"vocab_size": len(tok), **ARCH, **arch})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    from posttrain.evaluate import evaluate_policy
    from posttrain.models import builtin_model_dir, load_causal_lm, load_tokenizer
    from posttrain.trainers.offline import SFTConfig, run_sft

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(builtin_model_dir()))
    p.add_argument("--steps", type=int, default=SFT["max_steps"])
    p.add_argument("--work", default=None, help="run directory (default: a temp dir)")
    p.add_argument("--episodes", action="store_true",
                   help="build builtin-episodes (the multi-turn task's start) instead")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(args.work or tempfile.mkdtemp(prefix="posttrain-build-"))
    if args.episodes:
        out = Path(args.out) if args.out != str(builtin_model_dir()) else \
            builtin_model_dir("builtin-episodes")
        print(json.dumps(build_episodes(out, work, args.steps if args.steps != SFT["max_steps"]
                                        else EPISODES_SFT["max_steps"])))
        return 0
    init_dir = work / "init"
    init_model(init_dir)
    cfg = SFTConfig(model=str(init_dir), output_dir=str(work / "sft"), device="cpu",
                    **{**SFT, "max_steps": args.steps})
    cfg.validate()
    metrics = run_sft(cfg)
    final = work / "sft" / "final"
    model = load_causal_lm(str(final), device="cpu")
    tok = load_tokenizer(str(final))
    acc = evaluate_policy(model, tok, task.rl_rows(500, "eval"), task.reward, max_new_tokens=8)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(final, out)
    print(json.dumps({"eval_loss": metrics.get("eval/loss"), "greedy": acc}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
