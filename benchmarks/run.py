"""The benchmark suite against TRL in one command: GRPO, DPO and reward-model training, each
at identical settings, on the ~0.5M, ~25M and ~180M (151,936-token vocabulary) models,
posttrain and TRL alternating run by run (A B B A …), with the machine's matmul rate
measured in the same session.

    python benchmarks/run.py [--benches grpo dpo rm] [--sizes small medium large]
        [--repeats 2] [--json FILE]

For every (benchmark, size) it prints one Markdown row: each library's median s/step and
tokens/s, the speed-up as the ratio of medians and as the median (range) of the per-repeat
ratios (two runs made back to back: the shared machine's speed drifts), each library's
peak RSS and their ratio, and the achieved GFLOP/s of each against the fp32 matmul peak
measured at the start (``torch.mm`` of 2048² matrices on the same threads).

FLOPs are the step's model work, the same for both libraries: 2·P per token for a forward,
4·P for a backward, where P counts the matmul parameters a token meets (the decoder blocks,
plus the LM head where logits are computed; attention's own score and value products, a
few per cent at these lengths, are left out). GRPO (8 prompts × 8 completions, 32 new
tokens, β 0.04): sampling, the reference pass and the update's forward and backward, 10·P
per completion token. DPO (16 pairs): the policy's forward and backward and the
reference's forward over every token, 8·P. RM (16 pairs): forward and backward over every
token with a scalar head, 6·P (no LM head).

Needs the bench extra: pip install -e '.[bench]'. The large model's runs take most of the
time: about 25 minutes for the whole suite on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import SIZES, child_env, run_comparisons, scratch

STEPS = {"grpo": {"small": 8, "medium": 8, "large": 5},
         "dpo": {"small": 12, "medium": 12, "large": 6},
         "rm": {"small": 12, "medium": 12, "large": 6}}
"""Steps per run (the first two are skipped as warm-up)."""


def matmul_peak_gflops(threads: int, n: int = 2048, repeats: int = 10) -> float:
    """The best fp32 ``torch.mm`` rate of ``n``² matrices over ``repeats`` tries, GFLOP/s."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def _params(size: str) -> tuple[int, int]:
    """(decoder-block matmul parameters, LM-head parameters) of a benchmark size."""
    from posttrain.builtin.tokenizer import build_tokenizer

    arch = {**SIZES[size]}
    H, inter, L = arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"]
    kv = H * arch["num_key_value_heads"] // arch["num_attention_heads"]
    block = L * (2 * H * H + 2 * H * kv + 3 * H * inter)
    vocab = arch.get("vocab_size") or len(build_tokenizer())
    return block, vocab * H


def _tokens_per_step(bench: str) -> float:
    """Tokens a step computes on: GRPO's completion tokens (a random model rarely stops
    before 32), DPO's and RM's sequence tokens of their 16 pairs."""
    if bench == "grpo":
        return 8 * 8 * 32.0
    from posttrain.builtin import task
    from posttrain.builtin.tokenizer import build_tokenizer

    tok = build_tokenizer()
    rows = task.preference_rows(64, "train")
    per_pair = statistics.fmean(len(tok(r["prompt"] + r["chosen"])["input_ids"])
                                + len(tok(r["prompt"] + r["rejected"])["input_ids"])
                                for r in rows)
    return 16 * per_pair


def flops_per_step(bench: str, size: str, tokens: float) -> float:
    """The model work of a step over ``tokens`` (see the module docstring)."""
    block, head = _params(size)
    if bench == "grpo":
        return 10 * (block + head) * tokens
    if bench == "dpo":
        return 8 * (block + head) * tokens
    return 6 * block * tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--benches", nargs="+", default=["grpo", "dpo", "rm"],
                   choices=["grpo", "dpo", "rm"])
    p.add_argument("--sizes", nargs="+", default=["small", "medium", "large"],
                   choices=list(SIZES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    threads = int(child_env()["OMP_NUM_THREADS"])
    peak = matmul_peak_gflops(threads)
    import torch
    import transformers
    import trl

    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, {threads} threads, torch "
          f"{torch.__version__}, transformers {transformers.__version__}, TRL {trl.__version__}; "
          f"fp32 matmul peak {peak:.0f} GFLOP/s (2048², best of 10)")
    print("| benchmark | model | TRL s/step | posttrain s/step | speed-up (per-repeat) | "
          "TRL tok/s | posttrain tok/s | TRL peak RSS | posttrain peak RSS (ratio) | "
          "TRL GFLOP/s | posttrain GFLOP/s (of peak) |")
    print("|---" * 11 + "|")
    rows = []
    for bench in args.benches:
        module = importlib.import_module(f"{bench}_speed")
        for size in args.sizes:
            ns = argparse.Namespace(sizes=[size], settings=["identical"],
                                    repeats=args.repeats, steps=STEPS[bench][size],
                                    warmup=args.warmup)
            with scratch(None, f"posttrain-suite-{bench}-") as work:
                ((_, _, trl_res, pt_res),) = run_comparisons(module.__file__, ns, work)
            ratios = sorted(a / b for a, b in zip(trl_res["step_s_runs"],
                                                  pt_res["step_s_runs"], strict=True))
            tokens = _tokens_per_step(bench)
            flops = flops_per_step(bench, size, tokens)
            row = {"bench": bench, "size": size, "trl_step_s": trl_res["step_s"],
                   "posttrain_step_s": pt_res["step_s"],
                   "speedup": trl_res["step_s"] / pt_res["step_s"],
                   "speedup_per_repeat": ratios, "trl_rss_mib": trl_res["rss_mib"],
                   "posttrain_rss_mib": pt_res["rss_mib"],
                   "trl_gflops": flops / trl_res["step_s"] / 1e9,
                   "posttrain_gflops": flops / pt_res["step_s"] / 1e9,
                   "tokens_per_step": tokens, "matmul_peak_gflops": peak}
            rows.append(row)
            print(f"| {bench} | {size} | {row['trl_step_s']:.3f} | {row['posttrain_step_s']:.3f}"
                  f" | {row['speedup']:.2f}× ({statistics.median(ratios):.2f}, "
                  f"{ratios[0]:.2f}–{ratios[-1]:.2f}) | {tokens / row['trl_step_s']:.0f} | "
                  f"{tokens / row['posttrain_step_s']:.0f} | {row['trl_rss_mib']:.0f} MiB | "
                  f"{row['posttrain_rss_mib']:.0f} MiB "
                  f"({row['posttrain_rss_mib'] / row['trl_rss_mib']:.2f}×) | "
                  f"{row['trl_gflops']:.1f} | {row['posttrain_gflops']:.1f} "
                  f"({row['posttrain_gflops'] / peak:.0%}) |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
