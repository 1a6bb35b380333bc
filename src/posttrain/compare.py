"""``posttrain compare``: the algorithms side by side on the built-in task, from the same start
under the same budget, over several seeds, written up as a Markdown report with learning
curves.

Every algorithm starts from the built-in SFT'd model (the ``sft`` row is that start,
evaluated) and trains until it has spent the budget: ``--budget tokens`` ends each run after
the step that takes its completion tokens past ``--tokens`` (RL: every token sampled;
DPO: the chosen and rejected completions trained on), ``--budget seconds`` after
``--seconds`` of training steps (posttrain's ``max_tokens`` / ``max_seconds``). Each run is its
own ``posttrain`` process (so its peak resident memory is its own), with a constant learning
rate, evaluated during training for the curves and, at the end, on one fixed held-out set
for the table: greedy accuracy, mean reward, and the KL divergence of the trained policy
from the start on its own samples of the held-out prompts.

With ``--moe true`` (the default) it also asks whether GSPO's sequence-level ratio is more
stable than GRPO's token-level one for a mixture-of-experts policy: the built-in model is
upcycled into a Mixtral-style model (each MLP copied into 4 experts, 2 routed per token,
a fresh router; :func:`build_moe_start`), SFT'd briefly so the experts part, and both
algorithms train it off-policy (2 epochs over 2 minibatches, so ratios leave 1 and routing
can move between the rollout and the update), reporting clip fractions, the ratios' spread,
KL and accuracy across seeds.

    posttrain compare [--algos sft dpo ppo grpo dapo gspo dr_grpo rloo] [--seeds 3]
        [--budget tokens|seconds] [--tokens 40000] [--seconds 20] [--moe true|false]
        [--output runs/compare]

Writes ``OUTPUT/report.md``, ``OUTPUT/curves.png`` (accuracy against tokens and against
seconds), ``OUTPUT/results.json`` and each run under ``OUTPUT/runs/``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_ALGOS = ("sft", "dpo", "ppo", "grpo", "dapo", "gspo", "dr_grpo", "rloo")
RL_ALGOS = ("grpo", "dapo", "gspo", "gspo_token", "dr_grpo", "rloo", "reinforce_pp",
            "reinforce_pp_baseline")
EVAL_SIZE = 300
"""Held-out problems every final model is scored on (the same ones for every run)."""
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
MOE_SFT_STEPS = 150
MOE_RL = ["--ppo_epochs", "2", "--minibatch_size", "64"]
"""Off-policy updates for the MoE study: 2 epochs over 2 minibatches of a step's 128
samples, so every update after the first sees ratios ≠ 1."""


def _command(algo: str) -> list[str]:
    if algo == "dpo":
        return ["dpo"]
    if algo == "ppo":
        return ["ppo"]
    if algo in RL_ALGOS:
        return ["grpo", "--algo", algo]
    raise ValueError(f"compare: unknown algorithm {algo!r}; choose from sft, dpo, ppo, "
                     f"{', '.join(RL_ALGOS)}")


def _spawn(args: list[str], log: Path) -> tuple[int, float, float]:
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


def _budget_args(budget: str, tokens: int, seconds: float) -> list[str]:
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
    args = [*_command(algo), "--model", model, "--output_dir", str(out), "--overwrite", "true",
            "--seed", str(seed), "--device", device, "--tensorboard", "false", "--log_every",
            "1", "--builtin_eval_size", "100", *every, *budget, *extra]
    code, rss, wall = _spawn(args, out.parent / f"{out.name}.log")
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

    def __call__(self, model_dir: str | Path) -> dict[str, float]:
        import torch

        from posttrain.data import pad_sequences
        from posttrain.evaluate import evaluate_policy
        from posttrain.models import completion_logprobs, load_causal_lm
        from posttrain.rollout import SamplingParams, generate

        model = load_causal_lm(str(model_dir), device=self.device).eval()
        result = evaluate_policy(model, self.tok, self.rows, self.reward, max_new_tokens=8)
        prompts = [r["prompt"] for r in self.rows]
        with torch.no_grad():
            r = generate(model, self.tok, prompts, n=1, params=SamplingParams(
                temperature=1.0, max_new_tokens=8), generator=torch.Generator().manual_seed(0))
            ids = [self.tok(p)["input_ids"] for p in prompts]
            comp = [c[:n].tolist() for c, n in zip(r.completion_ids, r.lengths, strict=True)]
            b = pad_sequences(ids, comp, self.tok.pad_token_id)
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


def upcycle(dense, noise: float = 0.01, seed: int = 0):
    """A Mixtral-style mixture of experts made from the Llama-family ``dense`` model
    (sparse upcycling): attention, norms and embeddings copied, each MLP copied into every
    expert (times ``1 + noise·N(0, 1)`` elementwise, so the experts can part), a router
    drawn small. With ``noise = 0`` it computes what ``dense`` computes whatever the
    routing: the top-k weights sum to 1 over identical experts."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    c = dense.config
    cfg = MixtralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                        intermediate_size=c.intermediate_size,
                        num_hidden_layers=c.num_hidden_layers,
                        num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads,
                        head_dim=c.hidden_size // c.num_attention_heads,
                        max_position_embeddings=c.max_position_embeddings,
                        rms_norm_eps=c.rms_norm_eps,
                        rope_parameters=getattr(c, "rope_parameters", None),
                        tie_word_embeddings=c.tie_word_embeddings, sliding_window=None,
                        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
                        eos_token_id=c.eos_token_id, router_aux_loss_coef=0.0, **MOE)
    torch.manual_seed(seed)
    moe = MixtralForCausalLM(cfg).to(next(dense.parameters()).dtype)
    missing, unexpected = moe.load_state_dict(
        {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}, strict=False)
    left = [k for k in missing if ".mlp." not in k]
    if left or unexpected:
        raise RuntimeError(f"upcycling: {(left + unexpected)[:3]} did not carry over")
    g = torch.Generator().manual_seed(seed)

    def jitter(w):
        return w * (1 + noise * torch.randn(w.shape, generator=g)) if noise else w

    with torch.no_grad():
        for layer, source in zip(moe.model.layers, dense.model.layers, strict=True):
            mlp = source.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            for e in range(cfg.num_local_experts):
                layer.mlp.experts.gate_up_proj[e].copy_(jitter(gate_up))
                layer.mlp.experts.down_proj[e].copy_(jitter(mlp.down_proj.weight))
            layer.mlp.gate.weight.normal_(0, 0.02, generator=g)
    return moe


def build_moe_start(out: Path, device: str, seed: int = 0, sft_steps: int | None = None
                    ) -> Path:
    """The built-in model upcycled (:func:`upcycle`) into ``out/upcycled`` and SFT'd on the
    built-in task for ``sft_steps`` steps so the experts part; returns that run's
    ``final/``, the study's start."""
    from posttrain.models import load_causal_lm, load_tokenizer

    sft_steps = sft_steps or MOE_SFT_STEPS
    upcycled = out / "upcycled"
    upcycle(load_causal_lm("builtin", device="cpu"), seed=seed).save_pretrained(upcycled)
    load_tokenizer("builtin").save_pretrained(upcycled)
    sft = out / "sft"
    code, _, _ = _spawn(["sft", "--model", str(upcycled), "--output_dir", str(sft),
                         "--overwrite", "true", "--max_steps", str(sft_steps), "--lr", "1e-3",
                         "--batch_size", "128", "--builtin_train_size", "20000",
                         "--max_length", "32", "--warmup_ratio", "0.05", "--device", device,
                         "--tensorboard", "false", "--log_every", "50",
                         "--builtin_eval_size", "20", "--seed", str(seed)],
                        out / "sft.log")
    if code != 0:
        raise RuntimeError(f"compare: the MoE start's SFT failed (log: {out / 'sft.log'})")
    return sft / "final"


def _stats(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _pm(xs: list[float], fmt: str = "{:.1%}") -> str:
    m, s = _stats(xs)
    return f"{fmt.format(m)} ± {fmt.format(s)}"


def _moe_metrics(rows: list[dict]) -> dict[str, float]:
    """Means over a run's training rows of what says how far the update strayed."""
    keys = {"clip_low": "train/clip_frac_low", "clip_high": "train/clip_frac_high",
            "ratio_max": "train/ratio_max", "ratio_min": "train/ratio_min",
            "train_kl": "train/kl"}
    out = {}
    for name, key in keys.items():
        xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))
              and math.isfinite(r[key])]
        out[name] = statistics.fmean(xs) if xs else float("nan")
    out["clip"] = out["clip_low"] + out["clip_high"]
    out["ratio_spread"] = out["ratio_max"] - out["ratio_min"]
    return out


def run_compare(algos: list[str], seeds: int, budget: str, tokens: int, seconds: float,
                moe: bool, output: str | Path, device: str = "cpu", moe_seeds: int | None = None,
                log=print) -> Path:
    """Run the study and write its report; returns the report's path."""
    for a in algos:
        if a != "sft":
            _command(a)
    if seeds < 1 or tokens < 1 or seconds <= 0:
        raise ValueError("compare: --seeds, --tokens and --seconds must be positive")
    if budget not in ("tokens", "seconds"):
        raise ValueError(f"compare: --budget is tokens or seconds, not {budget!r}")
    out = Path(output)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    limit = _budget_args(budget, tokens, seconds)
    t0 = time.perf_counter()
    scorer = Scorer("builtin", device)
    results: dict = {"budget": budget, "tokens": tokens, "seconds": seconds, "seeds": seeds,
                     "algos": {}, "moe": None}
    start = scorer("builtin")
    for algo in algos:
        if algo == "sft":
            results["algos"]["sft"] = [{**start, "tokens": 0, "train_s": 0.0, "wall_s": 0.0,
                                        "peak_rss_mib": float("nan"), "curve": []}]
            continue
        per_seed = []
        for seed in range(seeds):
            d = runs / f"{algo}-seed{seed}"
            got = train(algo, "builtin", d, seed, limit, device)
            final = scorer(d / "final")
            last = [r for r in got["rows"] if "samples/tokens_total" in r][-1]
            points = curve(algo, d, got["rows"], scorer)
            if not points or points[-1][0] < last["samples/tokens_total"]:  # the end point
                points.append((last["samples/tokens_total"], last["time/train_s"],
                               final["accuracy"]))
            per_seed.append({**final, "tokens": last["samples/tokens_total"],
                             "train_s": last["time/train_s"], "wall_s": got["wall_s"],
                             "peak_rss_mib": got["peak_rss_mib"], "curve": points})
            log(f"[compare] {algo} seed {seed}: accuracy {final['accuracy']:.1%}, "
                f"{per_seed[-1]['tokens']} tokens, {per_seed[-1]['train_s']:.1f} s "
                f"({time.perf_counter() - t0:.0f} s so far)")
        results["algos"][algo] = per_seed
    if moe:
        results["moe"] = _moe_study(out, device, moe_seeds or seeds, limit, log)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    figure = _plot(results, out / "curves.png")
    report = out / "report.md"
    report.write_text(_report(results, start, figure, time.perf_counter() - t0))
    log(f"[compare] done in {time.perf_counter() - t0:.0f} s: {report}")
    return report


def _moe_study(out: Path, device: str, seeds: int, limit: list[str], log) -> dict:
    start = build_moe_start(out / "moe", device)
    scorer = Scorer(str(start), device)
    study = {"start": scorer(start), "runs": {}}
    log(f"[compare] MoE start (upcycled, SFT'd): accuracy {study['start']['accuracy']:.1%}")
    for algo in ("grpo", "gspo"):
        study["runs"][algo] = []
        for seed in range(seeds):
            d = out / "runs" / f"moe-{algo}-seed{seed}"
            got = train(algo, str(start), d, seed, limit, device, MOE_RL)
            rows = [r for r in got["rows"] if "train/ratio_max" in r]
            final = scorer(d / "final")
            study["runs"][algo].append({**final, **_moe_metrics(rows),
                                        "wall_s": got["wall_s"]})
            log(f"[compare] MoE {algo} seed {seed}: accuracy {final['accuracy']:.1%}, clip "
                f"{study['runs'][algo][-1]['clip']:.3f}")
    return study


def _plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    start = results["algos"].get("sft", [{}])[0].get("accuracy")
    # every run starts at the start's accuracy, at 0 tokens and 0 seconds
    origin = [(0, 0.0, start)] if start is not None else []
    for colour, (algo, runs) in enumerate(results["algos"].items()):
        for j, r in enumerate(runs if algo != "sft" else []):
            pts = origin + [tuple(p) for p in r["curve"]]
            for x, ax in enumerate(axes):  # x: 0 tokens, 1 seconds
                ax.plot([p[x] for p in pts], [p[2] for p in pts], color=f"C{colour}",
                        alpha=0.8, lw=1.2, label=algo if j == 0 and x == 0 else None)
    for ax, label in zip(axes, ("completion tokens", "training seconds"), strict=True):
        if start is not None:
            ax.axhline(start, color="grey", ls="--", lw=1)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("posttrain compare: the built-in task, from the SFT start (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _report(results: dict, start: dict, figure: Path | None, total_s: float) -> str:
    import torch

    from posttrain import __version__

    b = results["budget"]
    spend = (f"{results['tokens']:,} completion tokens" if b == "tokens"
             else f"{results['seconds']:g} s of training steps")
    lines = [
        "# posttrain compare", "",
        f"posttrain {__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs "
        f"(threads {torch.get_num_threads()}), {time.strftime('%Y-%m-%d')}; "
        f"the whole study took {total_s / 60:.1f} min.", "",
        f"Every algorithm starts from the built-in SFT'd model and trains until it has spent "
        f"{spend}, {results['seeds']} seeds each (mean ± std over seeds). Accuracy and reward: "
        f"greedy decoding of {EVAL_SIZE} fixed held-out problems; KL: of the trained policy "
        "from the start, on its own samples of those prompts (nats per completion).", "",
        "| algorithm | accuracy | reward | KL to start | tokens | train s | wall s | "
        "peak RSS MiB |", "|---|---|---|---|---|---|---|---|"]
    for algo, runs in results["algos"].items():
        name = "sft (the start)" if algo == "sft" else algo
        if algo == "sft":
            lines.append(f"| {name} | {start['accuracy']:.1%} | {start['reward']:.3f} | 0 | "
                         "0 | 0 | – | – |")
            continue
        col = lambda k, runs=runs: [r[k] for r in runs]  # noqa: E731
        lines.append(
            f"| {name} | {_pm(col('accuracy'))} | {_pm(col('reward'), '{:.3f}')} | "
            f"{_pm(col('kl'), '{:.3f}')} | {statistics.fmean(col('tokens')):,.0f} | "
            f"{statistics.fmean(col('train_s')):.1f} | {statistics.fmean(col('wall_s')):.1f} | "
            f"{statistics.fmean(col('peak_rss_mib')):.0f} |")
    if figure is not None:
        lines += ["", f"![held-out accuracy against tokens and seconds]({figure.name})"]
    above = [a for a, runs in results["algos"].items() if a != "sft"
             and statistics.fmean(r["accuracy"] for r in runs) > start["accuracy"]]
    lines += ["", f"Above the start: {len(above)} of "
              f"{len([a for a in results['algos'] if a != 'sft'])} ({', '.join(above)})."]
    moe = results.get("moe")
    if moe:
        lines += ["", "## Mixture of experts: GRPO against GSPO", "",
                  "The built-in model upcycled to a Mixtral-style policy "
                  f"({MOE['num_local_experts']} experts, {MOE['num_experts_per_tok']} per "
                  f"token) and SFT'd for "
                  f"{MOE_SFT_STEPS} steps (start accuracy {moe['start']['accuracy']:.1%}); "
                  "2 epochs over 2 minibatches per step, so updates run off-policy. Means over "
                  "each run's steps, then mean ± std over seeds.", "",
                  "| algorithm | accuracy | clip fraction | ratio max − min | KL to start |",
                  "|---|---|---|---|---|"]
        for algo, runs in moe["runs"].items():
            col = lambda k, runs=runs: [r[k] for r in runs]  # noqa: E731
            lines.append(f"| {algo} | {_pm(col('accuracy'))} | {_pm(col('clip'), '{:.3f}')} | "
                         f"{_pm(col('ratio_spread'), '{:.3f}')} | {_pm(col('kl'), '{:.3f}')} |")
        lines += ["", _moe_verdict(moe)]
    return "\n".join(lines) + "\n"


def _moe_verdict(moe: dict) -> str:
    g, s = moe["runs"]["grpo"], moe["runs"]["gspo"]
    acc_g, sd_g = _stats([r["accuracy"] for r in g])
    acc_s, sd_s = _stats([r["accuracy"] for r in s])
    spread_g = statistics.fmean(r["ratio_spread"] for r in g)
    spread_s = statistics.fmean(r["ratio_spread"] for r in s)
    stable = acc_s >= acc_g - sd_g and sd_s <= sd_g and spread_s < spread_g
    return ("**At this scale GSPO's stability advantage " + ("shows" if stable else
            "does not show") + f"**: accuracy {acc_s:.1%} ± {sd_s:.1%} (GSPO) against "
            f"{acc_g:.1%} ± {sd_g:.1%} (GRPO), ratio spread {spread_s:.3f} against "
            f"{spread_g:.3f}. GSPO's ratio is a per-sequence geometric mean, so its spread is "
            "narrower by construction, and its clip range (3e-4 / 4e-4) is about 1000× "
            "narrower than GRPO's 0.2, so it clips far more sequences by design; what would "
            "show an advantage is steadier accuracy across seeds, or GRPO failing where GSPO "
            "does not.")


__all__ = ["DEFAULT_ALGOS", "Scorer", "build_moe_start", "run_compare", "train"]
