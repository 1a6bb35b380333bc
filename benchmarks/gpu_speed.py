"""What the CUDA paths do on a GPU: the quick-start GRPO run (accuracy before/after,
s/step), the GRPO speed benchmark's 25M "identical" step (8 prompts × 8 completions,
32 new tokens, β = 0.04) with its time split, and the rollout engines (lean decoder against
``model.generate``), each in float32 and bfloat16. Prints one JSON line per measurement.

Usage: python benchmarks/gpu_speed.py [--steps 8]   (needs a CUDA device; see gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SIZES


def _median_rows(out: Path, keys: tuple[str, ...], skip: int) -> dict[str, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step_s" in r][skip:]
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in keys if k in rows[0]}


def quick_start(work: Path, dtype: str) -> dict:
    """``posttrain grpo`` with its defaults on the built-in model and task."""
    from posttrain.trainers.online import RLConfig, run_rl

    out = work / f"quick-{dtype}"
    cfg = RLConfig(output_dir=str(out), device="cuda", dtype=dtype, tensorboard=False,
                   log_every=1)
    cfg.validate()
    start = time.perf_counter()
    last = run_rl(cfg)
    wall = time.perf_counter() - start
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return {"what": "quick_start", "dtype": dtype, "steps": cfg.max_steps,
            "accuracy_before": first.get("eval/accuracy"),
            "accuracy_after": last.get("eval/accuracy"), "wall_s": round(wall, 1),
            **_median_rows(out, ("time/step_s", "time/generate_s", "time/update_s"), 2)}


def grpo_step(work: Path, size: str, dtype: str, steps: int, compile: bool = False) -> dict:
    """The grpo_speed.py "identical" setting on a random model of ``size``."""
    from posttrain.builtin.build import init_model
    from posttrain.trainers.online import RLConfig, run_rl

    model_dir = work / f"model-{size}"
    if not model_dir.exists():
        init_model(model_dir, **SIZES[size])
    out = work / f"grpo-{size}-{dtype}-{'compiled' if compile else 'eager'}"
    cfg = RLConfig(model=str(model_dir), output_dir=str(out), algo="grpo", max_steps=steps,
                   prompts_per_step=8, group_size=8, max_new_tokens=32, lr=1e-5,
                   kl_coef=0.04, minibatch_size=64, micro_batch_size=64, device="cuda",
                   dtype=dtype, builtin_eval_size=0, eval_every=0, log_every=1,
                   tensorboard=False, compile=compile)
    cfg.validate()
    run_rl(cfg)
    keys = ("time/step_s", "time/generate_s", "time/reward_s", "time/update_s",
            "time/tokens_per_s", "completion/length_mean")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r["time/step_s"] for r in rows if "time/step_s" in r)
    return {"what": "grpo_identical", "size": size, "dtype": dtype, "compile": compile,
            "first_step_s": round(first, 3), **_median_rows(out, keys, 2)}


def rollout(work: Path, size: str, dtype: str) -> dict:
    """64 completions × 32 tokens: the lean decoder against ``model.generate``."""
    from posttrain.builtin import task
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rollout import SamplingParams, generate

    model_dir = work / f"model-{size}"
    model = load_causal_lm(str(model_dir), dtype=dtype, device="cuda").eval()
    tok = load_tokenizer(str(model_dir))
    prompts = [r["prompt"] for r in task.rl_rows(8, "train")]
    params = SamplingParams(max_new_tokens=32)
    enc = tok([p for p in prompts for _ in range(8)], return_tensors="pt", padding=True,
              padding_side="left").to("cuda")

    def lean():
        generate(model, tok, prompts, 8, params, torch.Generator().manual_seed(0))

    def hf():
        with torch.no_grad():
            model.generate(**enc, do_sample=True, max_new_tokens=32, min_new_tokens=32,
                           pad_token_id=tok.pad_token_id)

    result = {"what": "rollout", "size": size, "dtype": dtype}
    for name, fn in (("lean_s", lean), ("hf_generate_s", hf)):
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        result[name] = round(statistics.median(times[1:]), 4)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--work", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_speed.py needs a CUDA device", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="posttrain-gpu-"))
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name()}))
    for dtype in ("float32", "bfloat16"):
        print(json.dumps(quick_start(work, dtype)), flush=True)
    for size in ("small", "medium"):
        for dtype in ("float32", "bfloat16"):
            print(json.dumps(grpo_step(work, size, dtype, args.steps)), flush=True)
            print(json.dumps(rollout(work, size, dtype)), flush=True)
    for dtype in ("float32", "bfloat16"):
        print(json.dumps(grpo_step(work, "medium", dtype, args.steps, compile=True)),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
