"""One on-policy loop for the critic-free RL algorithms of the table (grpo, dapo, gspo,
gspo_token, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline).

Each step:

1. **sample** G completions for each of ``prompts_per_step`` prompts (the lean rollout engine);
   with dynamic sampling (DAPO) groups whose rewards are all equal are dropped and more
   prompts are sampled, up to ``dynamic_sampling_rounds`` rounds;
2. **score** with the reward terms (plus DAPO's overlong shaping when the algorithm asks);
3. **advantages** with the algorithm's estimator;
4. ``ppo_epochs`` passes of **minibatch updates** against the old log-probabilities, each
   optimiser step accumulated over micro-batches with the loss normalised by the token or
   sequence count of the whole minibatch, optional KL to a frozen reference;
5. **metrics** to metrics.jsonl.

The loop never branches on the algorithm's name; it reads the
:class:`posttrain.core.algorithms.Algorithm` record. Samples whose advantage is zero on every
token and that carry no KL term add nothing to the gradient; they skip the forward and
backward pass (the normaliser still counts them, so the gradient is unchanged).
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
from posttrain.config import ConfigError, TrainConfig, _check
from posttrain.core import (
    aggregate_loss,
    groups_with_signal,
    masked_mean,
    overlong_penalty,
    step_normalizer,
)
from posttrain.core.algorithms import (
    ALGORITHMS,
    Algorithm,
    compute_advantages,
    get_algorithm,
    policy_objective,
)
from posttrain.evaluate import evaluate_policy
from posttrain.modeling import (
    completion_logprobs,
    has_plain_head,
    load_causal_lm,
    load_tokenizer,
    save_model,
    shared_prompt_logprobs,
)
from posttrain.rewards import parse_rewards, score
from posttrain.rollout import Rollout, SamplingParams, concat, generate, select
from posttrain.trainers.base import MetricsWriter, seed_everything

log = logging.getLogger(__name__)
CRITIC_FREE = [name for name, a in ALGORITHMS.items() if not a.critic]


@dataclass
class RLConfig(TrainConfig):
    """On-policy RL with verifiable rewards (the GRPO family)."""

    algo: str = "grpo"
    """grpo, dapo, gspo, gspo_token, dr_grpo, rloo, reinforce_pp or reinforce_pp_baseline."""
    reward: str | None = None
    """Reward terms, comma-separated: builtin, module:function, file.py:function, rm:DIR;
    none = builtin (the built-in task's exact-answer reward)."""
    reward_weights: str | None = None
    """Weights of the reward terms, comma-separated (default 1 each)."""
    on_reward_error: str = "raise"
    """raise: stop on a reward that fails or is NaN; skip: leave the sample out and count it."""
    lr: float = 1e-4
    max_steps: int = 60
    prompts_per_step: int = 16
    """Prompts (groups) per step."""
    group_size: int = 8
    """Completions per prompt (G)."""
    minibatch_size: int = 128
    """Samples per optimiser step (several steps per batch when smaller than the batch)."""
    micro_batch_size: int = 128
    """Samples per forward/backward pass; the gradient does not depend on it."""
    ppo_epochs: int = 1
    """Passes over each batch of samples (μ); > 1 records old log-probs before updating."""
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: str | None = None
    """Stop strings, comma-separated (eos always stops)."""
    kl_coef: float | None = None
    """Override the algorithm's β (KL to the reference in the loss)."""
    clip_low: float | None = None
    """Override the algorithm's ε_low."""
    clip_high: float | None = None
    """Override the algorithm's ε_high."""
    overlong_cache: int = 2
    """DAPO's soft overlong buffer L_cache, in tokens below max_new_tokens."""
    dynamic_sampling_rounds: int = 4
    """Most generation rounds per step when dynamic sampling refills the batch."""
    share_prompt: bool | None = None
    """Run each group's prompt once for its G completions in the update and reference
    passes; none = automatic (on from 2M parameters)."""
    skip_zero_advantage: bool = True
    """Leave samples with zero advantage and no KL term out of the forward/backward pass
    (the gradient is the same; false only to measure what skipping saves)."""
    eval_every: int = 20
    warmup_ratio: float = 0.0
    lr_schedule: str = "constant"

    def validate(self) -> None:
        super().validate()
        _check(self.algo in CRITIC_FREE, f"algo must be one of {', '.join(CRITIC_FREE)}")
        _check(self.group_size >= 2, "group_size must be ≥ 2")
        _check(min(self.prompts_per_step, self.minibatch_size, self.micro_batch_size,
                   self.ppo_epochs, self.dynamic_sampling_rounds, self.max_new_tokens) >= 1,
               "prompts_per_step, minibatch_size, micro_batch_size, ppo_epochs, "
               "dynamic_sampling_rounds and max_new_tokens must be ≥ 1")
        _check(self.on_reward_error in ("raise", "skip"), "on_reward_error must be raise or skip")
        _check(self.temperature > 0, "temperature must be > 0 for RL sampling")

    def algorithm(self) -> Algorithm:
        overrides = {k: v for k, v in (("kl_coef", self.kl_coef), ("clip_low", self.clip_low),
                                       ("clip_high", self.clip_high)) if v is not None}
        return get_algorithm(self.algo, **overrides)


@dataclass
class Experience:
    """One step's scored samples, ready for updates."""

    rollout: Rollout
    scores: torch.Tensor  # (N,) total reward used for advantages
    terms: dict[str, torch.Tensor]  # per reward term (N,)
    valid: torch.Tensor  # (N,) False for samples skipped on a reward error
    rounds: int
    dropped_groups: int


# Below this size a step is bound by per-call overhead, and running the prompts in their own
# forward call costs more than the prompt tokens it saves (as measured for DPO).
SHARE_PROMPT_MIN_PARAMS = 2_000_000


class TokenBatch:
    """A step's samples in the completion layout: every per-token tensor is ``(N, Lc)``, one
    column per generated token (masks, advantages, old and reference log-probs).

    With ``share_prompt`` each group's prompt is run once and its keys and values are shared
    by the group's completions (:func:`shared_prompt_logprobs`); otherwise each sample is a
    full prompt + completion sequence.
    """

    def __init__(self, rollout: Rollout, pad_id: int, device, share_prompt: bool):
        self.share = share_prompt
        self.completion_ids = rollout.completion_ids.to(device)
        self.completion_mask = rollout.completion_mask.to(device)
        if share_prompt:
            groups, index = torch.unique(rollout.group_ids, return_inverse=True)
            rows = torch.arange(len(index))
            first = torch.full((len(groups),), len(index)).scatter_reduce(
                0, index, rows, reduce="amin")  # first sample of each group
            ids, mask = data_mod.pad_left([rollout.prompt_ids[i] for i in first.tolist()],
                                          pad_id)
            self.prompt_ids, self.prompt_mask = ids.to(device), mask.to(device)
            self.prompt_index = index.to(device)
        else:
            completions = [r[m.bool()].tolist() for r, m in
                           zip(rollout.completion_ids, rollout.completion_mask, strict=True)]
            full = data_mod.pad_sequences(rollout.prompt_ids, completions, pad_id)
            self.full = {k: v.to(device) for k, v in full.items()}
            self.prompt_lengths = torch.tensor([len(p) for p in rollout.prompt_ids],
                                               device=device)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def logprobs(self, model, rows: torch.Tensor, with_entropy: bool = False):
        """Log-probs (and entropy) of the completions of ``rows``, ``(len(rows), Lc)``."""
        if self.share:
            groups, index = torch.unique(self.prompt_index[rows], return_inverse=True)
            return shared_prompt_logprobs(model, self.prompt_ids[groups],
                                          self.prompt_mask[groups], self.completion_ids[rows],
                                          self.completion_mask[rows], prompt_index=index,
                                          with_entropy=with_entropy)
        out = completion_logprobs(model, self.full["input_ids"][rows],
                                  self.full["attention_mask"][rows],
                                  self.full["loss_mask"][rows], with_entropy=with_entropy)
        outs = out if with_entropy else (out,)
        # completion token j of a row sits at sequence position len(prompt) + j, so its
        # log-prob is column len(prompt) + j - 1 of the (T - 1) layout
        Lc = self.completion_ids.shape[1]
        cols = self.prompt_lengths[rows][:, None] - 1 + torch.arange(Lc, device=rows.device)
        mask = self.completion_mask[rows].bool()
        cols = cols.clamp_max(outs[0].shape[1] - 1)
        res = [torch.where(mask, x.gather(1, cols), 0.0) for x in outs]
        return tuple(res) if with_entropy else res[0]


def accumulate_policy_gradient(policy, algo: Algorithm, tokens: TokenBatch, mask: torch.Tensor,
                               idx: torch.Tensor, adv: torch.Tensor, old: torch.Tensor | None,
                               ref: torch.Tensor | None, live: torch.Tensor,
                               micro_batch_size: int, constant: float) -> dict[str, float]:
    """Backward the loss of the minibatch ``idx`` in micro-batches, each aggregated with the
    normaliser of the whole minibatch (so the summed gradient does not depend on
    ``micro_batch_size``). ``mask``, ``adv``, ``old``, ``ref`` are ``(N, Lc)``. Rows not
    ``live`` are skipped. Returns the loss sum and metric means over micro-batches."""
    norm = step_normalizer(mask[idx], algo.aggregation)
    rows = idx[live[idx]]
    sums: dict[str, float] = {"loss": 0.0}
    n_micro = 0
    for i in range(0, len(rows), micro_batch_size):
        mb = rows[i:i + micro_batch_size]
        lp, ent = tokens.logprobs(policy, mb, with_entropy=True)
        old_mb = lp.detach() if old is None else old[mb]
        loss_tok, m = policy_objective(algo, lp, old_mb, adv[mb], mask[mb],
                                       None if ref is None else ref[mb])
        loss = aggregate_loss(loss_tok, mask[mb], algo.aggregation, norm, constant=constant)
        loss.backward()
        sums["loss"] += float(loss.detach())
        m["entropy"] = masked_mean(ent, mask[mb])
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        n_micro += 1
    return {k: (v if k == "loss" else v / max(n_micro, 1)) for k, v in sums.items()}


class RLTrainer:
    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self.algo = cfg.algorithm()
        self.out_dir = Path(cfg.output_dir or f"runs/{cfg.algo}")
        self.tok = load_tokenizer(cfg.model, cfg.trust_remote_code)
        self.policy = load_causal_lm(cfg.model, cfg.dtype, cfg.device, cfg.trust_remote_code)
        self.device = next(self.policy.parameters()).device
        share = cfg.share_prompt
        if share is None:
            share = sum(p.numel() for p in self.policy.parameters()) >= SHARE_PROMPT_MIN_PARAMS
        self.share_prompt = share and has_plain_head(self.policy)
        self.ref = None
        if self.algo.needs_reference:
            self.ref = load_causal_lm(cfg.model, cfg.dtype, cfg.device, cfg.trust_remote_code)
            self.ref.eval().requires_grad_(False)
        if cfg.data is None:
            self.train_rows = builtin_task.rl_rows(cfg.builtin_train_size, "train", cfg.seed)
            self.eval_rows = builtin_task.rl_rows(cfg.builtin_eval_size, "eval", cfg.seed)
        else:
            if not cfg.reward:
                raise ConfigError("--data needs --reward (module:function, file.py:function "
                                  "or rm:DIR)")
            self.train_rows = data_mod.load(cfg.data, "rl")[1]
            self.eval_rows = data_mod.load(cfg.eval_data, "rl")[1] if cfg.eval_data else []
        self.rewards = parse_rewards(cfg.reward or "builtin", cfg.reward_weights, cfg.device)
        stop = tuple(s for s in (cfg.stop or "").split(",") if s)
        self.params = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k,
                                     cfg.max_new_tokens, stop)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self._order: list[int] = []

    # --- sampling and scoring ----------------------------------------------------------------
    def _next_rows(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if not self._order:
                self._order = torch.randperm(len(self.train_rows), generator=self.gen).tolist()
            out.append(self.train_rows[self._order.pop()])
        return out

    def _score(self, rows: list[dict], rollout: Rollout):
        G = self.cfg.group_size
        rep = [r for r in rows for _ in range(G)]
        columns = {k: [r.get(k) for r in rep] for k in rows[0] if k not in ("prompt", "_row")}
        total, terms, valid = score(self.rewards, [r["prompt"] for r in rep], rollout.texts,
                                    columns, self.cfg.on_reward_error)
        if self.algo.overlong_shaping:
            shaping = overlong_penalty(rollout.lengths, self.cfg.max_new_tokens,
                                       min(self.cfg.overlong_cache, self.cfg.max_new_tokens))
            terms["overlong"] = shaping
            total = total + shaping
        return total, terms, valid

    def collect(self) -> Experience:
        """Sample and score a step's groups (refilling with dynamic sampling)."""
        cfg, want = self.cfg, self.cfg.prompts_per_step
        parts, kept, dropped, rounds = [], 0, 0, 0
        while kept < want and rounds < (cfg.dynamic_sampling_rounds
                                         if self.algo.dynamic_sampling else 1):
            rounds += 1
            rows = self._next_rows(want)
            rollout = generate(self.policy, self.tok, [r["prompt"] for r in rows],
                               cfg.group_size, self.params, self.gen)
            total, terms, valid = self._score(rows, rollout)
            if self.algo.dynamic_sampling:
                signal = groups_with_signal(total, rollout.group_ids)
                groups = rollout.group_ids[signal].unique()[: want - kept]
                keep = torch.isin(rollout.group_ids, groups).nonzero().squeeze(-1)
                dropped += len(rows) - int(signal.view(-1, cfg.group_size).any(-1).sum())
                rollout = select(rollout, keep)
                total, valid = total[keep], valid[keep]
                terms = {k: v[keep] for k, v in terms.items()}
                kept += len(groups)
            else:
                kept += len(rows)
            parts.append((rollout, total, terms, valid))
        if kept == 0:
            raise RuntimeError(
                f"dynamic sampling found no group with different rewards in {rounds} rounds of "
                f"{want} prompts: every group was all right or all wrong, so the data is too "
                "easy or too hard for this policy (or the reward is constant)")
        rollout = concat([p[0] for p in parts], self.tok.pad_token_id)
        return Experience(rollout, torch.cat([p[1] for p in parts]),
                          {k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]},
                          torch.cat([p[3] for p in parts]), rounds, dropped)

    # --- the loop ----------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        if not self.eval_rows:
            return {}
        terms = self.rewards
        fn = terms[0].fn if len(terms) == 1 else (
            lambda p, c, **kw: score(terms, p, c, kw, "skip")[0].tolist())
        r = evaluate_policy(self.policy, self.tok, self.eval_rows, fn, self.cfg.max_new_tokens,
                            self.cfg.eval_batch_size)
        return {"eval/accuracy": r["accuracy"], "eval/mean_reward": r["mean_reward"]}

    def step(self, opt) -> dict[str, float]:
        cfg, algo = self.cfg, self.algo
        t0 = time.perf_counter()
        exp = self.collect()
        t_gen = time.perf_counter()
        ro = exp.rollout
        tokens = TokenBatch(ro, self.tok.pad_token_id, self.device, self.share_prompt)
        mask = tokens.completion_mask.float() * exp.valid.to(self.device)[:, None]
        everyone = torch.arange(len(tokens), device=self.device)
        with torch.no_grad():
            old = tokens.logprobs(self.policy, everyone) if cfg.ppo_epochs > 1 else None
        ref = None
        if self.ref is not None:
            with torch.inference_mode():
                ref = tokens.logprobs(self.ref, everyone)
            ref = ref.clone()
        adv, _ = compute_advantages(algo, exp.scores.to(self.device),
                                    ro.group_ids.to(self.device), mask, old, ref)
        live = ((adv != 0).any(-1) if algo.kl_coef == 0 and cfg.skip_zero_advantage
                else mask.any(-1)) & exp.valid.to(self.device)
        t_score = time.perf_counter()
        sums: dict[str, float] = {}
        n_steps = 0
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(len(adv), generator=self.gen).to(self.device)
            for i in range(0, len(adv), cfg.minibatch_size):
                m = accumulate_policy_gradient(self.policy, algo, tokens, mask,
                                               perm[i:i + cfg.minibatch_size], adv, old, ref,
                                               live, cfg.micro_batch_size, cfg.max_new_tokens)
                if live[perm[i:i + cfg.minibatch_size]].any():
                    if cfg.max_grad_norm > 0:
                        m["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(
                            self.policy.parameters(), cfg.max_grad_norm))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    n_steps += 1
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
        t_train = time.perf_counter()
        G = cfg.group_size
        scores = exp.scores
        record = {f"train/{k}": v / max(n_steps, 1) for k, v in sums.items()}
        record.update({
            "reward/mean": float(scores.mean()), "reward/std": float(scores.std()),
            **{f"reward/{k}": float(v.nan_to_num().mean()) for k, v in exp.terms.items()},
            "reward/task_accuracy": float((next(iter(exp.terms.values())) >= 1).float().mean()),
            "reward/skipped": int((~exp.valid).sum()),
            "completion/length_mean": float(ro.lengths.float().mean()),
            "completion/length_max": int(ro.lengths.max()),
            "completion/truncated_frac": float(ro.truncated.float().mean()),
            "groups/zero_signal_frac": float((~groups_with_signal(scores, ro.group_ids))
                                             .view(-1, G).all(-1).float().mean()),
            "groups/dropped": exp.dropped_groups, "sampling/rounds": exp.rounds,
            "samples/backward_frac": float(live.float().mean()),
            "optim/steps": n_steps,
            "time/generate_s": t_gen - t0, "time/score_s": t_score - t_gen,
            "time/train_s": t_train - t_score, "time/step_s": t_train - t0,
            "time/tokens_per_s": float(ro.lengths.sum()) / max(t_gen - t0, 1e-9),
        })
        return record

    def train(self) -> dict[str, float]:
        cfg = self.cfg
        seed_everything(cfg.seed)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        config_mod.dump(cfg, self.out_dir / "config.yaml")
        writer = MetricsWriter(self.out_dir, cfg.tensorboard)
        opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr,
                                weight_decay=cfg.weight_decay, fused=True)
        try:
            start = self.evaluate()
            writer.write(0, start)
            print(json.dumps({"step": 0, **start}), flush=True)
            last: dict[str, float] = {}
            for step in range(1, cfg.max_steps + 1):
                record = self.step(opt)
                if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.max_steps:
                    record.update(self.evaluate())
                writer.write(step, record)
                last.update(record)
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    print(f"[{cfg.algo}] step {step}/{cfg.max_steps}  reward "
                          f"{record['reward/mean']:.3f}  sample acc "
                          f"{record['reward/task_accuracy']:.3f}  "
                          f"{record['time/step_s']:.2f} s/step", flush=True)
                if cfg.save_every and step % cfg.save_every == 0 and step != cfg.max_steps:
                    save_model(self.policy, self.tok, self.out_dir / f"checkpoint-{step}")
            final = self.evaluate()
            writer.write(cfg.max_steps, final)
            last.update(final)
            save_model(self.policy, self.tok, self.out_dir / "final")
        finally:
            writer.close()
        print(json.dumps({"step": cfg.max_steps, "start/accuracy": start.get("eval/accuracy"),
                          **final}), flush=True)
        return last


def run_rl(cfg: RLConfig) -> dict[str, float]:
    return RLTrainer(cfg).train()
