"""One on-policy loop for the critic-free RL algorithms of the table (grpo, dapo, gspo,
gspo_token, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline).

Each step: sample G completions for each of ``prompts_per_step`` prompts → score them →
advantages (the algorithm's estimator) → ``ppo_epochs`` passes of minibatch updates against
the recorded old log-probabilities, with the algorithm's policy loss, optional KL to a frozen
reference and its aggregation → metrics. The loop never branches on the algorithm's name; it
reads the :class:`posttrain.core.algorithms.Algorithm` record.

Samples whose advantage is zero on every token and that carry no KL term contribute nothing
to the gradient; they are dropped before the forward/backward pass (the normaliser is still
counted over the whole minibatch, so the gradient is unchanged).

Not yet here (tracked in the online-RL issue): DAPO's dynamic sampling refill, per-function
reward weights and logging, the trained-reward-model reward, and PPO's critic.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain import config as config_mod
from posttrain import data as data_mod
from posttrain.builtin import task as builtin_task
from posttrain.config import TrainConfig, _check
from posttrain.core import aggregate_loss, overlong_penalty, step_normalizer
from posttrain.core.algorithms import (
    ALGORITHMS,
    compute_advantages,
    get_algorithm,
    policy_objective,
)
from posttrain.evaluate import evaluate_policy, load_reward_function
from posttrain.modeling import completion_logprobs, load_causal_lm, load_tokenizer, save_model
from posttrain.rollout import SamplingParams, generate
from posttrain.trainers.base import MetricsWriter, seed_everything

log = logging.getLogger(__name__)


@dataclass
class RLConfig(TrainConfig):
    """On-policy RL with a verifiable reward (GRPO family)."""

    algo: str = "grpo"
    """grpo, dapo, gspo, gspo_token, dr_grpo, rloo, reinforce_pp or reinforce_pp_baseline."""
    reward: str | None = None
    """Reward function module:function or file.py:function; none = the built-in task's."""
    lr: float = 1e-4
    max_steps: int = 60
    prompts_per_step: int = 16
    """Prompts sampled per step."""
    group_size: int = 8
    """Completions per prompt (G)."""
    minibatch_size: int = 64
    """Samples per optimiser step within an RL step."""
    ppo_epochs: int = 1
    """Passes over each batch of samples (μ)."""
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    kl_coef: float | None = None
    """Override the algorithm's β (KL to the reference in the loss)."""
    clip_low: float | None = None
    """Override the algorithm's ε_low."""
    clip_high: float | None = None
    """Override the algorithm's ε_high."""
    overlong_cache: int = 2
    """DAPO soft overlong buffer L_cache (tokens before max_new_tokens)."""
    eval_every: int = 20
    warmup_ratio: float = 0.0
    lr_schedule: str = "constant"

    def validate(self) -> None:
        super().validate()
        names = [a for a in ALGORITHMS if not ALGORITHMS[a].critic]
        _check(self.algo in names, f"algo must be one of {', '.join(names)}")
        _check(self.group_size >= 2, "group_size must be ≥ 2")
        _check(self.prompts_per_step >= 1 and self.minibatch_size >= 1 and self.ppo_epochs >= 1,
               "prompts_per_step, minibatch_size and ppo_epochs must be ≥ 1")

    def algorithm(self):
        overrides = {k: v for k, v in (("kl_coef", self.kl_coef), ("clip_low", self.clip_low),
                                       ("clip_high", self.clip_high)) if v is not None}
        return get_algorithm(self.algo, **overrides)


def _sequences(rollout, pad_id):
    completions = [row[m.bool()].tolist() for row, m in
                   zip(rollout.completion_ids, rollout.completion_mask, strict=True)]
    return data_mod.pad_sequences(rollout.prompt_ids, completions, pad_id)


def run_rl(cfg: RLConfig) -> dict[str, float]:
    seed_everything(cfg.seed)
    algo = cfg.algorithm()
    out_dir = Path(cfg.output_dir or f"runs/{cfg.algo}")
    out_dir.mkdir(parents=True, exist_ok=True)
    config_mod.dump(cfg, out_dir / "config.yaml")
    tok = load_tokenizer(cfg.model, cfg.trust_remote_code)
    policy = load_causal_lm(cfg.model, cfg.dtype, cfg.device, cfg.trust_remote_code)
    ref = None
    if algo.needs_reference:
        ref = load_causal_lm(cfg.model, cfg.dtype, cfg.device, cfg.trust_remote_code)
        ref.eval().requires_grad_(False)
    device = next(policy.parameters()).device
    if cfg.data is None:
        train_rows = builtin_task.rl_rows(cfg.builtin_train_size, "train", cfg.seed)
        eval_rows = builtin_task.rl_rows(cfg.builtin_eval_size, "eval", cfg.seed)
        reward_fn = builtin_task.reward
    else:
        _, train_rows = data_mod.load(cfg.data, "rl")
        eval_rows = data_mod.load(cfg.eval_data, "rl")[1] if cfg.eval_data else []
        if not cfg.reward:
            raise config_mod.ConfigError("--data needs --reward module:function")
    if cfg.reward:
        reward_fn = load_reward_function(cfg.reward)
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            fused=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    writer = MetricsWriter(out_dir, cfg.tensorboard)

    def evaluate():
        if not eval_rows:
            return {}
        r = evaluate_policy(policy, tok, eval_rows, reward_fn, cfg.max_new_tokens,
                            cfg.eval_batch_size)
        return {"eval/accuracy": r["accuracy"], "eval/mean_reward": r["mean_reward"]}

    start = evaluate()
    writer.write(0, start)
    print(json.dumps({"step": 0, **start}))
    order = torch.randperm(len(train_rows), generator=gen).tolist()
    cursor = 0
    last: dict[str, float] = {}
    for step in range(1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        if cursor + cfg.prompts_per_step > len(order):
            order, cursor = torch.randperm(len(train_rows), generator=gen).tolist(), 0
        rows = [train_rows[i] for i in order[cursor:cursor + cfg.prompts_per_step]]
        cursor += cfg.prompts_per_step
        prompts = [r["prompt"] for r in rows]
        rollout = generate(policy, tok, prompts, cfg.group_size, params, gen)
        t_gen = time.perf_counter()

        rep = [r for r in rows for _ in range(cfg.group_size)]
        columns = {k: [r.get(k) for r in rep] for k in rows[0] if k not in ("prompt", "_row")}
        scores = torch.tensor(reward_fn([r["prompt"] for r in rep], rollout.texts, **columns),
                              dtype=torch.float32)
        task_scores = scores.clone()
        if algo.overlong_shaping:
            scores = scores + overlong_penalty(rollout.lengths, cfg.max_new_tokens,
                                               min(cfg.overlong_cache, cfg.max_new_tokens))
        t_score = time.perf_counter()

        batch = {k: v.to(device) for k, v in _sequences(rollout, tok.pad_token_id).items()}
        mask = batch["loss_mask"][:, 1:].float()  # (N, T-1) completion tokens
        with torch.no_grad():
            old = (completion_logprobs(policy, batch["input_ids"], batch["attention_mask"],
                                       batch["loss_mask"]) if cfg.ppo_epochs > 1 else None)
            ref_lp = (completion_logprobs(ref, batch["input_ids"], batch["attention_mask"],
                                          batch["loss_mask"]) if ref is not None else None)
        adv, _ = compute_advantages(algo, scores.to(device), rollout.group_ids.to(device), mask,
                                    old, ref_lp)
        # samples with no advantage and no KL term add nothing to the gradient
        live = (adv != 0).any(-1) if algo.kl_coef == 0 else torch.ones(len(adv), dtype=torch.bool)
        sums: dict[str, float] = {}
        n_updates = 0
        for _epoch in range(cfg.ppo_epochs):
            perm = torch.randperm(len(adv), generator=gen)
            for i in range(0, len(adv), cfg.minibatch_size):
                idx = perm[i:i + cfg.minibatch_size].to(device)
                norm = step_normalizer(mask[idx], algo.aggregation)
                idx = idx[live[idx]]
                if len(idx) == 0:
                    continue
                lp = completion_logprobs(policy, batch["input_ids"][idx],
                                         batch["attention_mask"][idx], batch["loss_mask"][idx])
                old_mb = lp.detach() if old is None else old[idx]
                loss_tok, m = policy_objective(algo, lp, old_mb, adv[idx], mask[idx],
                                               None if ref_lp is None else ref_lp[idx])
                loss = aggregate_loss(loss_tok, mask[idx], algo.aggregation, norm,
                                      constant=cfg.max_new_tokens)
                loss.backward()
                if cfg.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                n_updates += 1
                for k, v in {"loss": loss.detach(), **m}.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        t_train = time.perf_counter()
        groups = scores.view(-1, cfg.group_size)
        record = {f"train/{k}": v / max(n_updates, 1) for k, v in sums.items()}
        record.update({
            "reward/mean": float(scores.mean()), "reward/std": float(scores.std()),
            "reward/task_accuracy": float((task_scores >= 1).float().mean()),
            "completion/length_mean": float(rollout.lengths.float().mean()),
            "completion/length_max": float(rollout.lengths.max()),
            "completion/truncated_frac": float(rollout.truncated.float().mean()),
            "groups/zero_signal_frac": float((groups.max(1).values == groups.min(1).values)
                                             .float().mean()),
            "samples/backward_frac": float(live.float().mean()),
            "time/generate_s": t_gen - t0, "time/score_s": t_score - t_gen,
            "time/train_s": t_train - t_score, "time/step_s": t_train - t0,
            "time/tokens_per_s": float(mask.sum()) / max(t_gen - t0, 1e-9),
        })
        if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.max_steps:
            record.update(evaluate())
        writer.write(step, record)
        last.update(record)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            print(f"[{cfg.algo}] step {step}/{cfg.max_steps} reward {record['reward/mean']:.3f} "
                  f"acc {record['reward/task_accuracy']:.3f} "
                  f"{record['time/step_s']:.2f}s/step", flush=True)
    final = evaluate()
    writer.write(cfg.max_steps, final)
    writer.close()
    save_model(policy, tok, out_dir / "final")
    last.update(final)
    print(json.dumps({"step": cfg.max_steps, **final, "start/accuracy":
                      start.get("eval/accuracy")}))
    return last
