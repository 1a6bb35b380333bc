"""Context parallelism on the CPU: the forward and backward of one long sequence's summed
completion log-likelihood, in one process (2 threads) and split over 2 gloo ranks of one
thread each (``--context_parallel 2``, Ulysses), with each process's peak resident memory
and the step's median time. Every configuration runs in processes of its own, so each peak
is its own; "model RSS" is the resident memory once the model is loaded, before any step.

The claim checked: a sequence twice as long as one process can train fits with context
parallel 2, taking "can train" as a memory budget equal to one process's peak at the
shorter length ``--length``. Each process runs one warm-up step first and its peak is over
the ``--repeats`` steps after it (the peak reset before each, ``/proc/self/clear_refs``).
The budget is on **anonymous** memory (the peak resident size less the file-backed and
shared pages at the step's end): a rank's first step pages in ~6 MB more of the libraries'
code than one process's (gloo, c10d), pages shared between the ranks and reclaimable,
which the resident size counts (measured: docs/benchmarks.md). Both are printed.

The model is a random Llama of ``--hidden`` width and 8 layers (512: ~25M parameters),
positions up to 4 × ``--length``, the built-in tokenizer's vocabulary.

``--device cuda`` runs it on GPUs over NCCL (one GPU per rank: two or more GPUs); the peak
is then the device memory a step allocated (``torch.cuda.max_memory_allocated``, reset
before each step) and the time is taken after a synchronise (``benchmarks/gpu_check.sh``).

Usage: python benchmarks/context_parallel.py [--length 2048] [--hidden 512] [--repeats 2]
       [--device cpu|cuda]
Prints one JSON line per configuration and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def status_mb(*fields: str) -> list[float]:
    """Fields of ``/proc/self/status`` (kB there), in MB."""
    with open("/proc/self/status") as f:
        got = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in f
               if line.startswith(tuple(f"{x}:" for x in fields))}
    return [got.get(x, float("nan")) for x in fields]


def rss_mb() -> float:
    return status_mb("VmRSS")[0]


def child(args) -> None:
    from posttrain import dist
    from posttrain.models import completion_logprobs, context_parallel, load_causal_lm

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    dist.init(args.device)
    dist.set_context(dist.world_size())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
    model = context_parallel.enable(load_causal_lm(args.model, device=device))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, args.length), generator=gen)
    ids = ids.to(device)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, args.length // 4:] = 1
    model_rss = rss_mb()
    times, peaks, anon = [], [], []
    for i in range(args.repeats + 1):  # (the first a warm-up: see main's comment)
        model.zero_grad(set_to_none=True)
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # (the peak from here: VmHWM starts again at the resident size)
        t = time.perf_counter()
        lp = completion_logprobs(model, ids, None, loss_mask)
        lp.sum().backward()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        del lp
        hwm, file, shmem = status_mb("VmHWM", "RssFile", "RssShmem")
        if cuda:  # (the device's memory: what the step allocated, both columns)
            hwm, file, shmem = torch.cuda.max_memory_allocated() / 2**20, 0.0, 0.0
        if i:
            times.append(dt)
            peaks.append(hwm)
            anon.append(hwm - file - shmem)
    got = dist.gather_objects({"peak_mb": max(peaks), "anon_mb": max(anon),
                               "model_mb": model_rss})
    if dist.is_main():
        print(json.dumps({"ranks": dist.world_size(), "length": args.length,
                          "step_s": statistics.median(times),
                          "peak_mb": max(g["peak_mb"] for g in got),
                          "anon_mb": max(g["anon_mb"] for g in got),
                          "model_mb": max(g["model_mb"] for g in got)}), flush=True)
    dist.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", action="store_true")
    p.add_argument("--model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    if args.child:
        return child(args)
    from posttrain.builtin.build import init_model

    tmp = Path(tempfile.mkdtemp())
    init_model(tmp / "model", hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
               num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
               head_dim=args.hidden // 8, max_position_embeddings=4 * args.length)
    # glibc returns every block of 128 KiB or more to the system when it is freed, so a peak
    # is the memory the step held, not what the allocator kept of freed blocks (which
    # depends on the order of allocations, and differs between the two layouts)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    me = [str(Path(__file__).resolve()), "--child", "--model", str(tmp / "model"),
          "--repeats", str(args.repeats), "--device", args.device]
    results = []
    for ranks, length in ((1, args.length), (2, args.length), (1, 2 * args.length),
                          (2, 2 * args.length)):
        launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2"] if ranks == 2 else [sys.executable])
        threads = "1" if ranks == 2 else "2"
        proc = subprocess.run([*launch, *me, "--length", str(length), "--threads", threads],
                              env={**env, "OMP_NUM_THREADS": threads}, capture_output=True,
                              text=True, check=False)
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        line = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(line), flush=True)
        results.append(line)
    budget, rss_budget = results[0]["anon_mb"], results[0]["peak_mb"]
    print(f"\nbudget (one process's peak at {args.length} tokens): {budget:.1f} MB anonymous "
          f"({rss_budget:.1f} MB resident)\n")
    if args.device == "cuda":  # (both peaks are the device's: see the module docstring)
        print("(on CUDA both peak columns are the device memory allocated)\n")
    print("| ranks | tokens | step (s) | peak anonymous per process (MB) | peak RSS per "
          "process (MB) | model RSS (MB) | fits the budget (anonymous / RSS) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        fits = ["yes" if r[k] <= b else "no" for k, b in (("anon_mb", budget),
                                                          ("peak_mb", rss_budget))]
        print(f"| {r['ranks']} | {r['length']} | {r['step_s']:.2f} | {r['anon_mb']:.1f} | "
              f"{r['peak_mb']:.1f} | {r['model_mb']:.0f} | {' / '.join(fits)} |")


if __name__ == "__main__":
    main()
