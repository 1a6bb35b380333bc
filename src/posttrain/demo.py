"""A seconds-long demonstration of the algorithm core on a toy sequence task.

The "policy" is a table of logits, one row per position (no model, no tokenizer): it samples
completions of ``T`` tokens from a vocabulary of ``V``, and the reward is the share of tokens
equal to a target token. Each algorithm of the table trains it with the same loop — sample a
group per prompt, score, compute advantages, several epochs of clipped updates — and we print
the mean reward before and after. PPO gets a per-position value table as its critic.

This exercises the pure layer end to end; the real trainers on Hugging Face models live in
the trainer modules.
"""

from __future__ import annotations

import time

import torch

from posttrain.core import ALGORITHMS, aggregate_loss, step_normalizer, token_logprobs, value_loss
from posttrain.core.algorithms import PolicyInputs, compute_advantages, policy_objective


def _sample(logits: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)  # (T, V)
    return torch.multinomial(probs, n, replacement=True, generator=gen).T  # (n, T)


def run_algorithm(name: str, steps: int = 30, groups: int = 4, group_size: int = 8,
                  T: int = 8, V: int = 6, target: int = 2, seed: int = 0) -> tuple[float, float]:
    """Train the toy policy with ``name``; return mean reward of the first and last step."""
    algo = ALGORITHMS[name]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.zeros(T, V, requires_grad=True)
    values = torch.zeros(T, requires_grad=True)
    ref = logits.detach().clone()
    params = [logits, values] if algo.critic else [logits]
    opt = torch.optim.Adam(params, lr=0.1)
    # GSPO's clip range is tiny by design; the toy uses a wider one so its few steps move.
    if algo.policy_loss.startswith("gspo"):
        algo = algo.replace(clip_low=0.02, clip_high=0.03)
    n = groups * group_size
    group_ids = torch.arange(groups).repeat_interleave(group_size)
    mask = torch.ones(n, T)
    rewards = []
    for _ in range(steps):
        with torch.no_grad():
            tokens = _sample(logits, n, gen)  # (n, T)
            scores = (tokens == target).float().mean(-1)
            rewards.append(scores.mean().item())
            old_lp = token_logprobs(logits.expand(n, T, V), tokens)
            ref_lp = token_logprobs(ref.expand(n, T, V), tokens)
            old_v = values.expand(n, T).clone()
            adv, returns = compute_advantages(algo, scores, group_ids, mask, old_lp, ref_lp,
                                              old_v)
        for _epoch in range(2):
            lp = token_logprobs(logits.expand(n, T, V), tokens)
            loss_tok, _ = policy_objective(algo, PolicyInputs(lp, old_lp, adv, mask, ref_lp))
            loss = aggregate_loss(loss_tok, mask, algo.aggregation,
                                  step_normalizer(mask, algo.aggregation), constant=T)
            if algo.critic:
                v_tok, _ = value_loss(values.expand(n, T), old_v, returns, mask, algo.value_clip)
                loss = loss + algo.value_coef * aggregate_loss(v_tok, mask, "token_mean")
            opt.zero_grad()
            loss.backward()
            opt.step()
    return rewards[0], sum(rewards[-5:]) / 5


def main() -> int:
    print("posttrain core demo: toy task, reward = share of target tokens "
          "(random policy ≈ 0.17)")
    print(f"{'algorithm':<24}{'reward start':>14}{'reward end':>12}{'seconds':>10}")
    for name in ALGORITHMS:
        t0 = time.perf_counter()
        start, end = run_algorithm(name)
        print(f"{name:<24}{start:>14.3f}{end:>12.3f}{time.perf_counter() - t0:>10.2f}")
    return 0
