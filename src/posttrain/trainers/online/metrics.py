"""The metrics of one RL step, from what the step computed (no model calls here)."""

from __future__ import annotations

import torch

from posttrain.core import (
    explained_variance,
    groups_with_signal,
    kl_penalty,
    masked_mean,
    masked_sum,
)


def logprob_gap(recomputed: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor
                ) -> dict[str, float]:
    """How far the trainer's log-probs at the sampling weights are from the sampler's own,
    over the tokens of ``mask`` ``(N, Lc)``: mean and max ``|Δ|`` and the share above 0.1.
    Float rounding alone (another kernel, an incremental forward) keeps them near 1e-6; a
    different distribution (top-k / top-p truncation, a temperature not applied) shows."""
    m = mask.bool()
    if not m.any():
        return {}
    gap = (recomputed.float() - sampled.to(recomputed.device).float()).abs()[m]
    return {"sampling/logprob_gap_mean": float(gap.mean()),
            "sampling/logprob_gap_max": float(gap.max()),
            "sampling/logprob_gap_frac_gt_0.1": float((gap > 0.1).float().mean())}


def sample_metrics(exp) -> dict[str, float]:
    """What the step's samples scored and how long they ran: the reward (valid samples)
    and each term, the task accuracy, the samples skipped on a reward error, the
    completions' lengths and the share cut by the token budget (episodes: completion =
    every token after the first message; truncated = an episode cut at max_turns or
    max_episode_tokens)."""
    ro = exp.rollout
    raw = exp.scores[exp.valid] if exp.valid.any() else exp.scores
    return {
        "reward/mean": float(raw.mean()),
        "reward/std": float(raw.std()) if len(raw) > 1 else 0.0,
        **{f"reward/{k}": float(v.nan_to_num().mean()) for k, v in exp.terms.items()},
        "reward/task_accuracy": float(exp.correct[exp.valid].float().mean())
        if exp.valid.any() else 0.0,
        "reward/skipped": int((~exp.valid).sum()),
        "completion/length_mean": float(ro.lengths.float().mean()),
        "completion/length_max": int(ro.lengths.max()),
        "completion/truncated_frac": float(ro.truncated.float().mean()),
    }


def step_metrics(cfg, algo, exp, tokens, scores, mask, valid, old, ref, old_values, returns,
                 live, sums: dict[str, float], n_steps: int, n_critic_steps: int,
                 times: dict[str, float]) -> tuple[dict[str, float], float | None]:
    """The step's record and, when the reward carries a KL penalty, the mean per-sequence KL
    (what the adaptive controller tracks)."""
    ro = exp.rollout
    G = cfg.group_size
    n_updates = max(n_steps, n_critic_steps, 1)
    record = {f"train/{k}": v / n_updates for k, v in sums.items()}
    record.update(sample_metrics(exp))
    record.update({
        "groups/zero_signal_frac": float((~groups_with_signal(exp.scores, ro.group_ids))
                                         .view(-1, G).all(-1).float().mean()),
        "groups/dropped": exp.dropped_groups, "sampling/rounds": exp.rounds,
        "samples/backward_frac": float(live.float().mean()),
        "optim/steps": n_steps,
        **{f"time/{k}_s": v for k, v in times.items()},
        "time/tokens_per_s": float(ro.trained_mask.sum()) / max(times["generate"], 1e-9),
    })
    if ro.loss_mask is not None:  # episodes: the sampled tokens apart from the messages
        record["completion/sampled_tokens_mean"] = float(ro.loss_mask.sum(-1).float().mean())
    if ro.stats:
        record.update({f"episodes/{k}_mean": float(v.mean()) for k, v in ro.stats.items()
                       if k != "env_s"})
        if "env_s" in ro.stats:
            record["time/env_s"] = float(ro.stats["env_s"].sum())
        for k in ("trajectory_splits", "requests", "refused_requests",
                  "late_requests"):  # (--agent: counts)
            if k in ro.stats:
                record[f"agent/{k}"] = float(ro.stats[k].sum())
    if cfg.missing_eos_penalty or cfg.reward_normalize or cfg.reward_clip:
        record["reward/shaped_mean"] = float(scores[valid].mean())
    kl = None
    if algo.reward_kl_coef != 0:
        kl_tok = kl_penalty(old, ref, algo.reward_kl_estimator)
        kl = float(masked_sum(kl_tok, mask, dim=-1)[valid].mean())
        record.update({"kl/seq_mean": kl, "kl/coef": algo.reward_kl_coef,
                       "kl/token_mean": float(masked_mean(kl_tok, mask))})
    if old_values is not None:
        record.update({
            "critic/return_mean": float(masked_mean(returns, mask)),
            "critic/value_mean": float(masked_mean(old_values, mask)),
            "critic/explained_variance": float(explained_variance(old_values, returns, mask)),
            "critic/optim_steps": n_critic_steps,
        })
        for k in ("value_loss", "value_clip_frac", "critic_grad_norm"):
            if f"train/{k}" in record:
                record[f"critic/{k}"] = record.pop(f"train/{k}")
    return record, kl


def sample_table(exp, tokenizer, adv: torch.Tensor, mask: torch.Tensor, k: int) -> list[dict]:
    """The step's first ``k`` samples (groups are contiguous, so whole groups come together)
    as rows of plain values: the prompt, the completion (an episode's whole transcript after
    its first message), the reward and each term (None where a reward failed), the mean
    advantage over the sample's trained tokens, the length, the finish reason, whether it
    counts correct, and an episode's turns."""
    ro = exp.rollout
    n = min(k, len(ro.texts))
    adv, mask = adv[:n].detach().double().cpu(), mask[:n].detach().double().cpu()
    mean_adv = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    rows = []
    for i in range(n):
        ok = bool(exp.valid[i])
        row = {"sample": i, "group": int(ro.group_ids[i]),
               "prompt": tokenizer.decode(ro.prompt_ids[i], skip_special_tokens=True),
               "completion": ro.texts[i],
               "reward": float(exp.scores[i]) if ok else None}
        row.update({f"reward/{name}": float(v[i]) if ok else None
                    for name, v in exp.terms.items()})
        row.update({"advantage": float(mean_adv[i]), "length": int(ro.lengths[i]),
                    "finish": "length" if bool(ro.truncated[i]) else "stop",
                    "correct": bool(exp.correct[i])})
        if ro.stats is not None and "turns" in ro.stats:
            row["turns"] = int(ro.stats["turns"][i])
        rows.append(row)
    return rows
