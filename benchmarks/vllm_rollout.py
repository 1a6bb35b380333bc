"""Rollout through vLLM against the lean engine, and what the integration adds over a bare
``vllm.LLM.generate`` call, on the same model, requests and sampling settings, alternating
in one process: median seconds per rollout of P prompts × G completions, and the median
seconds of a weight sync (the policy's weights streamed into the engine).

Sizes: the built-in model (0.55M; 16 × 8, 8 new tokens), ``medium`` (~25M random init;
8 × 8, 32 new tokens), ``large`` (~180M, a 151,936-token vocabulary; 8 × 8, 32 tokens).
Run it in the vLLM environment (docs/engines.md). The bare call sends the very vLLM requests
the engine makes (same seeds, log-probs, stop tokens), so the difference is what the
integration adds: building requests, reading the outputs into tensors, decoding texts.

Usage: python benchmarks/vllm_rollout.py [--sizes builtin,medium,large] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SIZES

CASES = {"builtin": (16, 8, 8), "medium": (8, 8, 32), "large": (8, 8, 32)}


def _model_dir(size: str, work: str) -> str:
    from posttrain.builtin.build import init_model
    from posttrain.models.loading import builtin_model_dir

    if size == "builtin":
        return str(builtin_model_dir())
    path = Path(work) / size
    arch = dict(SIZES[size])
    init_model(path, **arch)
    return str(path)


def measure(size: str, repeats: int, work: str) -> dict[str, float]:
    from posttrain.builtin import task
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.models.weights import hf_weights
    from posttrain.rollout import SamplingParams, make_engine, requests_for

    P, G, T = CASES[size]
    path = _model_dir(size, work)
    model, tok = load_causal_lm(path, device="cpu").eval(), load_tokenizer(path)
    prompts = [r["prompt"] for r in task.rl_rows(P, "train")]
    params = SamplingParams(1.0, 1.0, 0, T, ())
    lean = make_engine("auto", model, tok)
    engine = make_engine("vllm", model, tok)
    # the very vLLM requests the engine makes (same seeds, logprobs, stops)
    bare_params = [engine._params(params, i) for i in range(P * G)]
    ids = [{"prompt_token_ids": tok(p)["input_ids"]} for p in prompts for _ in range(G)]

    def ours(e):
        def run(s):
            return e.generate(requests_for(tok, prompts, [s * 1000 + i for i in range(P)]),
                              G, params)
        return run

    runs = {"lean": ours(lean), "vllm": ours(engine),
            "bare LLM.generate": lambda s: engine.llm.generate(ids, bare_params,
                                                               use_tqdm=False),
            "sync": lambda s: engine.sync(hf_weights(model), s)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    with torch.no_grad():
        for fn in runs.values():
            fn(0)  # warm-up (vLLM's first generate is slow)
        for r in range(repeats):
            for k, fn in runs.items():
                t0 = time.perf_counter()
                fn(r + 1)
                times[k].append(time.perf_counter() - t0)
    engine.close()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="builtin,medium,large")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| size | P×G×T | lean s | vllm s | bare LLM.generate s | vllm / bare | sync s |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for size in args.sizes.split(","):
            m = measure(size, args.repeats, work)
            P, G, T = CASES[size]
            print(f"| {size} | {P}×{G}×{T} | {m['lean']:.3f} | {m['vllm']:.3f} | "
                  f"{m['bare LLM.generate']:.3f} | {m['vllm'] / m['bare LLM.generate']:.2f} | "
                  f"{m['sync']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
