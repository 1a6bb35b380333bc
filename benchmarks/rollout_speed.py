"""Rollout speed: posttrain's lean decoder against decoding through the model's own forward
(``engine="hf"``, same sampling code) and against ``transformers``' ``model.generate``, on the
same model, prompts and sampling settings, alternating in one process; median seconds per
rollout of P prompts × G completions.

Cases: the shipped built-in model on its RL settings (16 prompts × 8, up to 8 new tokens),
the same model upcycled into the 8-expert, top-2 Mixtral of ``posttrain compare --moe``
(where the lean decoder runs the expert blocks as the model's own modules), and the
random-init ~25M model of the speed comparisons (8 × 8, 32 new tokens).

Usage: python benchmarks/rollout_speed.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SIZES


def _hf_generate(model, tok, prompts, n, new_tokens, seed):
    ids = [tok(p)["input_ids"] for p in prompts]
    L = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (L - len(x)) + x for x in ids])
    mask = (torch.arange(L) >= torch.tensor([L - len(x) for x in ids])[:, None]).long()
    torch.manual_seed(seed)
    return model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True,
                          temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                          num_return_sequences=n, pad_token_id=tok.pad_token_id)


def _measure(path: str, P: int, G: int, T: int, repeats: int) -> dict[str, float]:
    from posttrain.builtin import task
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rollout import SamplingParams, generate

    model, tok = load_causal_lm(path, device="cpu"), load_tokenizer(path)
    prompts = [r["prompt"] for r in task.rl_rows(P, "train")]
    params = SamplingParams(1.0, 1.0, 0, T, ())

    def ours(engine):
        return lambda s: generate(model, tok, prompts, G, params,
                                  torch.Generator().manual_seed(s), engine=engine)

    runs = {"lean": ours("lean"), "hf": ours("hf"),
            "generate": lambda s: _hf_generate(model, tok, prompts, G, T, s)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    with torch.no_grad():
        for fn in runs.values():
            fn(0)  # warm-up
        for r in range(repeats):
            for k, fn in runs.items():
                t0 = time.perf_counter()
                fn(r)
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    from posttrain.builtin.build import init_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(tempfile.mkdtemp(prefix="posttrain-rollout-"))
    init_model(work / "medium", **SIZES["medium"])
    from posttrain.compare.moe import upcycle
    from posttrain.models import load_causal_lm, load_tokenizer

    upcycle(load_causal_lm("builtin", device="cpu"), noise=0.05).save_pretrained(work / "moe")
    load_tokenizer("builtin").save_pretrained(work / "moe")
    cases = [("built-in 0.85M", "builtin", 16, 8, 8),
             ("built-in upcycled, 8 experts top-2", str(work / "moe"), 16, 8, 8),
             ("random 25M", str(work / "medium"), 8, 8, 32)]
    print("| model | prompts x G | new tokens | lean s | hf-forward s | model.generate s | "
          "lean vs generate |\n|---|---|---|---|---|---|---|")
    for name, path, P, G, T in cases:
        med = _measure(path, P, G, T, args.repeats)
        print(f"| {name} | {P} x {G} | {T} | {med['lean']:.3f} | {med['hf']:.3f} | "
              f"{med['generate']:.3f} | {med['generate'] / med['lean']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
