"""Peak extra memory and time of posttrain's per-token log-prob path against the naive
``log_softmax(-1).gather(-1, ...)``, for B=8, T=512, float32 logits.

Each (method, vocabulary, mode) runs in a fresh subprocess. After a warm-up call we reset the
kernel's peak-RSS mark (``/proc/self/clear_refs``); "extra" is the peak during the timed calls
minus the resident size just before them (logits and labels already allocated). On a CUDA device the
same figures come from ``torch.cuda.max_memory_allocated``. Modes:

- ``forward``: under ``torch.no_grad()`` (reference / old log-probs);
- ``train``: forward and backward of ``sum(logprobs)`` (includes the logits' gradient, which
  is the same full-size tensor for both methods).

Usage: python benchmarks/logprobs.py [--repeats 3] [--vocab 32000 151936] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

B, T = 8, 512


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Reset the kernel's resident-set high-water mark (VmHWM) of this process (Linux ≥ 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _case(method: str, vocab: int, mode: str, repeats: int, device: str) -> dict:
    import torch

    from posttrain.core import token_logprobs

    def naive(logits, labels):
        return logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    fn = {"naive": naive, "posttrain": token_logprobs}[method]
    torch.manual_seed(0)
    logits = torch.randn(B, T, vocab, device=device)
    labels = torch.randint(0, vocab, (B, T), device=device)
    if mode == "train":
        logits.requires_grad_(True)
    cuda = device.startswith("cuda")

    def once():
        if mode == "forward":
            with torch.no_grad():
                out = fn(logits, labels)
        else:
            out = fn(logits, labels)
            out.sum().backward()
            logits.grad = None
        if cuda:
            torch.cuda.synchronize()
        return out

    once()  # warm-up (allocator, kernels)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_cpu = 0
    if not cuda:
        _reset_peak()
        base_cpu = _rss_bytes()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    extra = (torch.cuda.max_memory_allocated() - base) if cuda else (_peak_bytes() - base_cpu)
    return {"method": method, "vocab": vocab, "mode": mode, "extra_mib": extra / 2**20,
            "median_s": statistics.median(times), "logits_mib": B * T * vocab * 4 / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        method, vocab, mode = args.case
        print(json.dumps(_case(method, int(vocab), mode, args.repeats, args.device)))
        return 0

    rows = []
    for vocab in args.vocab:
        for mode in ("forward", "train"):
            for method in ("naive", "posttrain"):
                out = subprocess.run(
                    [sys.executable, __file__, "--case", method, str(vocab), mode,
                     "--repeats", str(args.repeats), "--device", args.device],
                    check=True, capture_output=True, text=True)
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"B={B} T={T} float32, device={args.device}, "
          f"threads={os.environ.get('OMP_NUM_THREADS', 'default')}, median of {args.repeats}")
    print("| V | mode | logits MiB | naive extra MiB | posttrain extra MiB | memory ratio "
          "| naive s | posttrain s | time ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i in range(0, len(rows), 2):
        n, p = rows[i], rows[i + 1]
        print(f"| {n['vocab']} | {n['mode']} | {n['logits_mib']:.0f} | {n['extra_mib']:.0f} | "
              f"{p['extra_mib']:.0f} | {p['extra_mib'] / max(n['extra_mib'], 1e-9):.1%} | "
              f"{n['median_s']:.3f} | {p['median_s']:.3f} | "
              f"{p['median_s'] / n['median_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
