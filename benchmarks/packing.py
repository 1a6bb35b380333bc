"""Padded against packed SFT micro-batches on a long-tailed length distribution: the step
time (forward and backward of the summed completion log-likelihood) and the peak resident
memory, each layout in a process of its own (so the peaks are its own), medians.

Lengths are drawn from a log-normal (median ``--median`` tokens, log-σ ``--sigma``), clipped
to ``[16, --max_len]``; a quarter of each is prompt. The model is a random Llama of
``--hidden`` width and 8 layers (512: ~25M parameters) with the built-in tokenizer.

``--device cuda`` runs it on a GPU: the peak is then the device memory the step allocated
(``torch.cuda.max_memory_allocated``, reset before each step) and the time is taken after a
synchronise (``benchmarks/gpu_check.sh``).

Usage: python benchmarks/packing.py [--examples 8] [--max_len 1024] [--median 128]
       [--sigma 1.0] [--hidden 512] [--repeats 3] [--budget 0|-1|N] [--device cpu|cuda]
Prints one JSON line per layout and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def lengths(args) -> list[int]:
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.examples, generator=gen) * args.sigma + math.log(args.median)
    return [int(min(max(16, round(math.exp(float(v)))), args.max_len)) for v in x]


def child(args) -> None:
    from posttrain.data import pack_sequences, packed_rows, pad_sequences
    from posttrain.models import completion_logprobs, load_causal_lm

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    model = load_causal_lm(args.model, device=args.device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts, completions = [], []
    for n in lengths(args):
        ids = torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
        prompts.append(ids[:n // 4])
        completions.append(ids[n // 4:])
    if args.layout == "padded":
        forwards = [pad_sequences(prompts, completions, 0)]
    elif args.budget > 0:  # a token budget: one packed row per forward, as the trainers run it
        forwards = [pack_sequences([prompts[i] for i in row], [completions[i] for i in row], 0)
                    for row in packed_rows(lengths(args), args.budget)]
    else:
        budget = max(lengths(args)) if args.budget < 0 else None
        forwards = [pack_sequences(prompts, completions, 0, budget=budget)]
    forwards = [{k: v.to(args.device) for k, v in b.items()} for b in forwards]
    times, peaks = [], []
    for i in range(args.repeats + cuda):  # (on a GPU one warm-up step first: kernels load)
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for batch in forwards:
            lp = completion_logprobs(model, batch["input_ids"], batch.get("attention_mask"),
                                     batch["loss_mask"], position_ids=batch.get("position_ids"))
            lp.sum().backward()
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() / 2**20)
        if i or not cuda:
            times.append(time.perf_counter() - t)
    peak = (max(peaks[1:]) if cuda else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps({"layout": args.layout, "forwards": len(forwards),
                      "rows": [sum(len(b["input_ids"]) for b in forwards),
                               max(b["input_ids"].shape[1] for b in forwards)],
                      "tokens": sum(int(b["input_ids"].numel()) for b in forwards),
                      "real_tokens": sum(map(len, prompts)) + sum(map(len, completions)),
                      "median_s": round(statistics.median(times), 3),
                      "peak_mib": round(peak)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--median", type=int, default=128)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=0,
                    help="packed rows' token budget (0: one row; -1: rows capped at the longest "
                    "sequence, one forward, as automatic packing runs them; N > 0: one row of "
                    "at most N tokens per forward, as --max_tokens_per_micro_batch N runs "
                    "them)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layout:
        return child(args)
    from posttrain.builtin.build import init_model

    model = tempfile.mkdtemp()
    init_model(Path(model), hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
               num_hidden_layers=8, num_attention_heads=args.hidden // 64,
               num_key_value_heads=args.hidden // 64, max_position_embeddings=args.max_len)
    print(json.dumps({"lengths": lengths(args)}))
    rows = {}
    for layout in ("padded", "packed"):
        argv = [a for a in sys.argv[1:]]
        out = subprocess.run([sys.executable, __file__, *argv, "--layout", layout, "--model",
                              model], capture_output=True, text=True, check=True)
        rows[layout] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(rows[layout]))
    a, b = rows["padded"], rows["packed"]
    kind = "CUDA allocated" if args.device == "cuda" else "RSS"
    print(f"\n| layout | forwards | rows × T | tokens | s / step | peak {kind} MiB |\n"
          "|---|---|---|---|---|---|")
    for r in (a, b):
        print(f"| {r['layout']} | {r['forwards']} | {r['rows'][0]} × {r['rows'][1]} | "
              f"{r['tokens']} | "
              f"{r['median_s']} | {r['peak_mib']} |")
    print(f"\npacked / padded: tokens {b['tokens'] / a['tokens']:.2f}, "
          f"time {b['median_s'] / a['median_s']:.2f}, "
          f"peak memory {b['peak_mib'] / a['peak_mib']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
