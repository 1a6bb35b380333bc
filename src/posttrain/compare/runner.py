"""The study's runs: each algorithm's training as its own ``posttrain`` process under one
budget, and the scoring of what each run wrote.

A run is a subprocess so that its peak resident memory is its own; it trains at a constant
learning rate until the budget is spent (posttrain's ``max_tokens`` / ``max_seconds``) and
is evaluated during training for the curves. :class:`Scorer` then scores its ``final/`` on
one fixed held-out set, the same for every run, for the table.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_ALGOS = ("sft", "dpo", "ppo", "grpo", "dapo", "gspo", "dr_grpo", "rloo")
RL_ALGOS = ("grpo", "dapo", "gspo", "gspo_token", "dr_grpo", "rloo", "reinforce_pp",
            "reinforce_pp_baseline")
EVAL_SIZE = 300
"""Held-out problems every final model is scored on (the same ones for every run)."""


def command(algo: str) -> list[str]:
    """The ``posttrain`` subcommand (and ``--algo``) that trains ``algo``."""
    if algo == "dpo":
        return ["dpo"]
    if algo == "ppo":
        return ["ppo"]
    if algo in RL_ALGOS:
        return ["grpo", "--algo", algo]
    raise ValueError(f"compare: unknown algorithm {algo!r}; choose from sft, dpo, ppo, "
                     f"{', '.join(RL_ALGOS)}")


def spawn(args: list[str], log: Path) -> tuple[int, float, float]:
    """``python -m posttrain ARGS`` with its output in ``log``: exit code, peak RSS (MiB),
    wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "posttrain", *args], stdout=f,
                                stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    rss = usage.ru_maxrss / 1024 if sys.platform != "darwin" else usage.ru_maxrss / 2**20
    return proc.returncode, rss, time.perf_counter() - t0


def budget_args(budget: str, tokens: int, seconds: float) -> list[str]:
    """The flags that end a run once it has spent ``tokens`` or ``seconds``."""
    # a step cap far past the budget, and a constant rate (a schedule over that cap would
    # spend the whole budget warming up)
    flag = ["--max_tokens", str(tokens)] if budget == "tokens" else ["--max_seconds",
                                                                      str(seconds)]
    return [*flag, "--max_steps", "100000", "--lr_schedule", "constant", "--warmup_ratio", "0"]


def train(algo: str, model: str, out: Path, seed: int, budget: list[str], device: str,
          extra: list[str] = ()) -> dict:
    """One run of ``algo`` from ``model`` into ``out``; its metrics rows, peak RSS and wall
    time. RL runs evaluate every 10 steps; DPO saves a checkpoint every 10 steps, which
    :func:`curve` evaluates afterwards (its own evaluation is of preference pairs)."""
    every = ["--save_every", "10"] if algo == "dpo" else ["--eval_every", "10"]
    args = [*command(algo), "--model", model, "--output_dir", str(out), "--overwrite", "true",
            "--seed", str(seed), "--device", device, "--tensorboard", "false", "--log_every",
            "1", "--builtin_eval_size", "100", *every, *budget, *extra]
    code, rss, wall = spawn(args, out.parent / f"{out.name}.log")
    if code != 0:
        tail = (out.parent / f"{out.name}.log").read_text().strip().splitlines()[-1:]
        raise RuntimeError(f"compare: {algo} (seed {seed}) failed with exit code {code}: "
                           f"{tail[0] if tail else ''} (log: {out.parent / out.name}.log)")
    from posttrain.plot import read_metrics

    return {"rows": read_metrics(out), "peak_rss_mib": rss, "wall_s": wall}


class Scorer:
    """Scores a model on the fixed held-out problems: greedy accuracy, mean reward, and
    KL(policy ‖ start) estimated on the policy's own samples (temperature 1) of the same
    prompts, as the mean over completions of Σ_t log π(y_t) − log π_start(y_t)."""

    def __init__(self, start: str, device: str, n: int = EVAL_SIZE):
        from posttrain.builtin import task
        from posttrain.models import load_causal_lm, load_tokenizer

        self.rows, self.reward = task.rl_rows(n, "eval"), task.reward
        self.tok = load_tokenizer(start)
        self.device = device
        self.start = load_causal_lm(start, device=device).eval()

    def load(self, model_dir: str | Path):
        """A trained model, ready to score."""
        from posttrain.models import load_causal_lm

        return load_causal_lm(str(model_dir), device=self.device).eval()

    def samples(self, model, temperature: float, generator=None, engine: str = "auto"
                ) -> dict:
        """The held-out prompts each with one completion of ``model`` (up to 8 tokens, at
        ``temperature``; 0 is greedy), padded as a batch (on the CPU)."""
        import torch

        from posttrain.data import pad_sequences
        from posttrain.rollout import SamplingParams, generate

        prompts = [r["prompt"] for r in self.rows]
        with torch.no_grad():
            r = generate(model, self.tok, prompts, n=1, params=SamplingParams(
                temperature=temperature, max_new_tokens=8), generator=generator,
                engine=engine)
        ids = [self.tok(p)["input_ids"] for p in prompts]
        comp = [c[:n].tolist() for c, n in zip(r.completion_ids, r.lengths, strict=True)]
        return pad_sequences(ids, comp, self.tok.pad_token_id)

    def __call__(self, model) -> dict[str, float]:
        """The scores of ``model``: a directory, or a model :meth:`load` returned."""
        import torch

        from posttrain.evaluate import evaluate_policy
        from posttrain.models import completion_logprobs

        if isinstance(model, (str, Path)):
            model = self.load(model)
        result = evaluate_policy(model, self.tok, self.rows, self.reward, max_new_tokens=8)
        with torch.no_grad():
            b = self.samples(model, 1.0, torch.Generator().manual_seed(0))
            b = {k: v.to(model.device) for k, v in b.items()}
            lp = [completion_logprobs(m, b["input_ids"], b["attention_mask"], b["loss_mask"])
                  for m in (model, self.start)]
        kl = float((lp[0] - lp[1]).sum(-1).mean())
        return {"accuracy": result["accuracy"], "reward": result["mean_reward"], "kl": kl}


def curve(algo: str, out: Path, rows: list[dict], scorer: Scorer | None = None
          ) -> list[tuple[float, float, float]]:
    """(tokens, train seconds, held-out accuracy) through a run: its own evaluations (RL), or
    its checkpoints scored by ``scorer`` (DPO)."""
    at = {r["step"]: r for r in rows if "samples/tokens_total" in r}
    points = []
    if algo == "dpo" and scorer is not None:
        for ckpt in sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
            step = int(ckpt.name.split("-")[1])
            if step in at:
                points.append((at[step]["samples/tokens_total"], at[step]["time/train_s"],
                               scorer(ckpt)["accuracy"]))
    else:
        for r in rows:
            if "eval/accuracy" in r and r["step"] in at:
                points.append((at[r["step"]]["samples/tokens_total"],
                               at[r["step"]]["time/train_s"], r["eval/accuracy"]))
    return points


def run_algos(algos: list[str], seeds: int, limit: list[str], device: str, runs: Path,
              scorer: Scorer, start: dict, t0: float, log) -> dict[str, list[dict]]:
    """Every algorithm of ``algos`` from the built-in start, one run per seed into ``runs``:
    per algorithm, a row per seed of the final model's scores, the spend and the curve.
    ``sft`` is the start itself (``start``, its scores), with nothing spent."""
    results = {}
    for algo in algos:
        if algo == "sft":
            results["sft"] = [{**start, "tokens": 0, "train_s": 0.0, "wall_s": 0.0,
                               "peak_rss_mib": float("nan"), "curve": []}]
            continue
        per_seed = []
        for seed in range(seeds):
            per_seed.append(_run_seed(algo, seed, runs / f"{algo}-seed{seed}", limit, device,
                                      scorer))
            log(f"[compare] {algo} seed {seed}: accuracy {per_seed[-1]['accuracy']:.1%}, "
                f"{per_seed[-1]['tokens']} tokens, {per_seed[-1]['train_s']:.1f} s "
                f"({time.perf_counter() - t0:.0f} s so far)")
        results[algo] = per_seed
    return results


def _run_seed(algo: str, seed: int, d: Path, limit: list[str], device: str,
              scorer: Scorer) -> dict:
    """One seed of ``algo``: its final model scored, what it spent, and its curve, which
    ends at the final model (the last evaluation may come before the last step)."""
    got = train(algo, "builtin", d, seed, limit, device)
    final = scorer(d / "final")
    last = [r for r in got["rows"] if "samples/tokens_total" in r][-1]
    points = curve(algo, d, got["rows"], scorer)
    if not points or points[-1][0] < last["samples/tokens_total"]:  # the end point
        points.append((last["samples/tokens_total"], last["time/train_s"], final["accuracy"]))
    return {**final, "tokens": last["samples/tokens_total"], "train_s": last["time/train_s"],
            "wall_s": got["wall_s"], "peak_rss_mib": got["peak_rss_mib"], "curve": points}
