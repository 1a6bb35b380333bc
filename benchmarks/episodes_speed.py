"""Rollout throughput of episodes: many in flight (one engine call per turn for every
episode still running) against one episode at a time, on the built-in multi-turn task
(``builtin-episodes``, 2 turns), the same seeds and settings, alternating in one process.

Also measured: what reusing the earlier turns' keys and values saves. The lean and hf
engines keep each sample's KV cache for the next turn (``reusing_prefixes``); timed against
re-encoding each turn's whole context, with the share of that rollout spent prefilling the
turns after the first. vLLM reuses prefixes through its prefix cache: timed on and off.

Usage: python benchmarks/episodes_speed.py [--engines lean,hf,vllm] [--rows 16] [--group 4]
       [--repeats 3] [--env_latency_ms 0]
Prints one JSON line per measurement and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


class _SlowEnv:
    """The built-in environment with a fixed latency per call (``--env_latency_ms``)."""

    latency = 0.0

    def __init__(self, row, **kw):
        from posttrain.builtin.episodes import LookupEnv

        self.env = LookupEnv(row, **kw)

    def reset(self):
        return self.env.reset()

    def step(self, text):
        time.sleep(self.latency)
        return self.env.step(text)


def _engine(name: str, model, tok, prefix_caching: bool = True):
    from posttrain.rollout import make_engine

    if name != "vllm":
        return make_engine(name, model, tok)
    from posttrain.rollout.vllm import VLLMEngine, VLLMOptions

    return VLLMEngine(model, tok, VLLMOptions(prefix_caching=prefix_caching, max_model_len=128))


def _prefill_share(engine, run) -> tuple[float, float]:
    """Seconds of ``run()`` and the seconds the in-process engines spent prefilling the
    turns after the first (each turn's whole context: the earlier turns re-encoded, and the
    new message, which any engine must encode)."""
    import posttrain.rollout.engine as eng

    spent, calls = [0.0], [0]
    real = eng._prefill

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = real(*a, **k)
        if calls[0]:
            spent[0] += time.perf_counter() - t0
        calls[0] += 1
        return out

    eng._prefill = timed
    try:
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0, spent[0]
    finally:
        eng._prefill = real


def main(argv=None) -> int:
    from posttrain.builtin import episodes
    from posttrain.episodes import EnvSpec, EpisodeLimits, Renderer, run_episodes
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rollout import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="lean,hf")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--env_latency_ms", type=float, default=0.0)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    _SlowEnv.latency = args.env_latency_ms / 1000
    tok = load_tokenizer("builtin-episodes")
    model = load_causal_lm("builtin-episodes", device="cpu").eval()
    spec = EnvSpec(_SlowEnv, {}, 0.0, "LookupEnv")
    rows = episodes.rows(args.rows, "train")
    seeds = list(range(len(rows)))
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    limits = EpisodeLimits(4, 64)
    renderer = Renderer(tok)
    n_eps = len(rows) * args.group
    table = []
    for name in args.engines.split(","):
        settings = [("in flight", True), ("one at a time", False)]
        engines = {True: _engine(name, model, tok)}
        if name == "vllm":
            engines[False] = _engine(name, model, tok, prefix_caching=False)
            settings += [("in flight, no prefix cache", "nocache")]
        else:
            settings += [("in flight, earlier turns re-encoded", "reencode")]

        def batched(engine, reuse=True):
            return run_episodes(engine, tok, spec, rows, args.group, seeds, params, limits,
                                renderer=renderer, reuse=reuse)

        def serial(engine):
            for i, r in enumerate(rows):
                for _j in range(args.group):  # the same episode: its row's seed, sample j
                    run_episodes(engine, tok, spec, [r], 1, [seeds[i]], params, limits,
                                 renderer=renderer)

        batched(engines[True])  # warm-up
        times = {label: [] for label, _ in settings}
        prefill = []
        for _ in range(args.repeats):
            for label, mode in settings:
                if mode == "nocache":
                    t0 = time.perf_counter()
                    batched(engines[False])
                    dt = time.perf_counter() - t0
                elif mode == "reencode":
                    engine = engines[True]
                    dt, pre = _prefill_share(engine, lambda e=engine: batched(e, False))
                    prefill.append(pre / dt)
                elif mode:
                    t0 = time.perf_counter()
                    batched(engines[True])
                    dt = time.perf_counter() - t0
                else:
                    t0 = time.perf_counter()
                    serial(engines[True])
                    dt = time.perf_counter() - t0
                times[label].append(dt)
        base = statistics.median(times["in flight"])
        mode_of = dict(settings)
        for label, ts in times.items():
            med = statistics.median(ts)
            rec = {"engine": name, "setting": label, "episodes": n_eps, "median_s": med,
                   "episodes_per_s": n_eps / med, "vs_in_flight": med / base,
                   "env_latency_ms": args.env_latency_ms}
            if mode_of[label] == "reencode":
                rec["prefill_share"] = statistics.median(prefill)
            print(json.dumps(rec), flush=True)
            table.append(rec)
        for e in engines.values():
            e.close()
    print("\n| engine | setting | episodes/s | time vs in flight | later turns' prefill |")
    print("|---|---|---|---|---|")
    for r in table:
        share = f"{r['prefill_share']:.0%}" if "prefill_share" in r else ""
        print(f"| {r['engine']} | {r['setting']} | {r['episodes_per_s']:.1f} | "
              f"{r['vs_in_flight']:.2f}x | {share} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
