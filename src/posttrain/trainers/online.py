"""One on-policy loop for every RL algorithm of the table: the critic-free ones (grpo, dapo,
gspo, gspo_token, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline) and RLHF-PPO with its
four models (actor, critic, frozen reference, reward model or function).

Each step:

1. **sample** G completions for each of ``prompts_per_step`` prompts (the lean rollout engine);
   with dynamic sampling (DAPO) groups whose rewards are all equal are dropped and more
   prompts are sampled, up to ``dynamic_sampling_rounds`` rounds;
2. **score** with the reward terms (plus DAPO's overlong shaping when the algorithm asks);
   The score may get a missing-EOS penalty, running normalisation and clipping;
3. **advantages** with the algorithm's estimator: group statistics, or per-token rewards with
   a KL penalty to the reference (fixed or adaptive coefficient) followed by GAE over the
   critic's values (PPO) or discounted returns (REINFORCE++);
4. ``ppo_epochs`` passes of **minibatch updates** over the step's samples (the experience
   buffer, discarded afterwards) against the old log-probabilities, each optimiser step
   accumulated over micro-batches with the loss normalised by the token or sequence count of
   the whole minibatch, optional KL to a frozen reference in the loss; the critic, when
   there is one, takes its clipped value-loss step on the same minibatch (and alone during
   ``critic_warmup_steps``);
5. **metrics** to metrics.jsonl, checkpoints (actor, critic, optimiser and loop state) that
   ``resume_from`` continues.

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
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file

from posttrain import data as data_mod
from posttrain.builtin import task as builtin_task
from posttrain.config import ConfigError, TrainConfig, _check
from posttrain.core import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    aggregate_loss,
    explained_variance,
    groups_with_signal,
    kl_penalty,
    masked_mean,
    masked_sum,
    overlong_penalty,
    step_normalizer,
    value_loss,
)
from posttrain.core.algorithms import (
    ALGORITHMS,
    Algorithm,
    compute_advantages,
    get_algorithm,
    policy_objective,
)
from posttrain.evaluate import greedy_completions
from posttrain.modeling import (
    SHARE_PROMPT_MIN_PARAMS,
    completion_hidden,
    completion_logprobs,
    has_plain_head,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    packing_pays,
    save_model,
    shared_prompt_hidden,
    shared_prompt_logprobs,
    value_head,
)
from posttrain.rewards import parse_rewards, score
from posttrain.rollout import Rollout, SamplingParams, can_replay, concat, generate, select
from posttrain.trainers.base import (
    adamw,
    compile_models,
    load_optimizer,
    lr_lambda,
    save_optimizer,
    seed_everything,
    start_run,
)

log = logging.getLogger(__name__)
CRITIC_FREE = [name for name, a in ALGORITHMS.items() if not a.critic]
RLHF = ["ppo", "reinforce_pp", "reinforce_pp_baseline"]  # per-token KL in the reward
TOKEN_REWARD_ESTIMATORS = ("gae", "reinforce_pp", "reinforce_pp_baseline")


@dataclass
class RLConfig(TrainConfig):
    """On-policy RL with verifiable rewards (the GRPO family)."""

    ALGOS: ClassVar[list[str]] = CRITIC_FREE
    algo: str = "grpo"
    """grpo, dapo, gspo, gspo_token, dr_grpo, rloo, reinforce_pp or reinforce_pp_baseline."""
    reward: str | None = None
    """Reward terms, comma-separated: builtin, module:function, file.py:function, rm:DIR;
    none = builtin (the built-in task's exact-answer reward)."""
    reward_weights: str | None = None
    """Weights of the reward terms, comma-separated (default 1 each)."""
    on_reward_error: str = "raise"
    """raise: stop on a reward that fails or is NaN; skip: leave the sample out and count it."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of completions that hit max_new_tokens without eos or a
    stop string."""
    reward_normalize: bool = False
    """Normalise scores by the running mean and std of every score seen so far."""
    reward_clip: float = 0.0
    """Clip scores (after normalisation) to [-c, c]; 0 = no clipping."""
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
    """Passes over each batch of samples (μ). Old log-probs are recorded before the first
    update whenever a batch gives more than one optimiser step (μ > 1 or minibatch_size
    below the batch) or the reward carries a KL penalty; otherwise the ratio is 1 and the
    loss uses the detached current log-probs."""
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: str | None = None
    """Stop strings, comma-separated (eos always stops)."""
    kl_coef: float | None = None
    """Override the algorithm's β (KL to the reference in the loss)."""
    reward_kl_coef: float | None = None
    """Override k, the coefficient of the per-token KL penalty in the reward (ppo,
    reinforce_pp*); with kl_target set, its starting value."""
    reward_kl_estimator: str | None = None
    """Override the estimator of that penalty: k1 (default), k2 or k3."""
    kl_target: float = 0.0
    """Adaptive KL (Ziegler et al.): move k so the mean per-sequence KL to the reference
    tracks this many nats; 0 = fixed k."""
    kl_horizon: float = 10000.0
    """Samples over which the adaptive controller may move k by up to ±20%."""
    gamma: float | None = None
    """Override the discount γ of token-level returns (ppo, reinforce_pp*)."""
    lam: float | None = None
    """Override GAE's λ (ppo)."""
    clip_low: float | None = None
    """Override the algorithm's ε_low."""
    clip_high: float | None = None
    """Override the algorithm's ε_high."""
    overlong_cache: int = 2
    """DAPO's soft overlong buffer L_cache, in tokens below max_new_tokens."""
    dynamic_sampling_rounds: int = 4
    """Most generation rounds per step when dynamic sampling refills the batch."""
    share_prompt: bool | None = None
    """Run each group's prompt once for its G completions in the update, old, reference and
    critic passes; none = automatic (on when group_size > 1, else from 2M parameters)."""
    reuse_rollout_forward: bool = True
    """Keep the linear layers' outputs the sampler computed, and let the policy's passes that
    come before its first optimizer step (the update of a one-update step, the old
    log-probs) take them instead of running those matmuls again: 2·N FLOPs per completion
    token saved. Applies with share_prompt where the batch's passes take two calls (prompts,
    then completions over their KV cache; a batch of short rows packed into one call
    replays nothing, and the next rollouts are not captured while batches pack), the lean
    sampler (Llama-family), no dropout and no compile; false = always recompute."""
    skip_zero_advantage: bool = True
    """Leave samples with zero advantage and no KL term out of the forward/backward pass
    (the gradient is the same; false only to measure what skipping saves)."""
    resume_from: str | None = None
    """A checkpoint-<step>/ directory of an earlier run of the same config: continue from
    its actor, critic, optimiser states and loop state up to max_steps."""
    eval_every: int = 20
    warmup_ratio: float = 0.0
    lr_schedule: str = "constant"

    def validate(self) -> None:
        super().validate()
        _check(self.algo in self.ALGOS, f"algo must be one of {', '.join(self.ALGOS)}")
        algo = self.algorithm()
        _check(self.group_size >= 2 or not algo.needs_groups,
               f"group_size must be ≥ 2 for {self.algo}")
        _check(self.reward_clip >= 0 and self.missing_eos_penalty >= 0 and self.kl_target >= 0
               and self.kl_horizon > 0, "reward_clip, missing_eos_penalty and kl_target must "
               "be ≥ 0 and kl_horizon > 0")
        token_rewards = algo.advantage in TOKEN_REWARD_ESTIMATORS
        for key in ("reward_kl_coef", "reward_kl_estimator", "gamma", "lam", "kl_target"):
            if getattr(self, key) and not token_rewards:
                raise ConfigError(f"{key} applies to algorithms with per-token rewards "
                                  f"({', '.join(RLHF)}), not to {self.algo}")
        _check(0 <= algo.gamma <= 1 and 0 <= algo.lam <= 1, "gamma and lam must be in [0, 1]")
        _check(self.kl_target == 0 or algo.reward_kl_coef > 0,
               "kl_target needs a reward KL coefficient > 0 to adapt")
        _check(min(self.prompts_per_step, self.minibatch_size, self.micro_batch_size,
                   self.ppo_epochs, self.dynamic_sampling_rounds, self.max_new_tokens) >= 1,
               "prompts_per_step, minibatch_size, micro_batch_size, ppo_epochs, "
               "dynamic_sampling_rounds and max_new_tokens must be ≥ 1")
        _check(self.on_reward_error in ("raise", "skip"), "on_reward_error must be raise or skip")
        _check(self.temperature > 0, "temperature must be > 0 for RL sampling")

    def _overrides(self) -> dict:
        """Fields of the algorithm's record that this config sets."""
        given = {"kl_coef": self.kl_coef, "clip_low": self.clip_low,
                 "clip_high": self.clip_high, "reward_kl_coef": self.reward_kl_coef,
                 "reward_kl_estimator": self.reward_kl_estimator, "gamma": self.gamma,
                 "lam": self.lam}
        return {k: v for k, v in given.items() if v is not None}

    def algorithm(self) -> Algorithm:
        try:
            return get_algorithm(self.algo, **self._overrides())
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class PPOConfig(RLConfig):
    """RLHF with a per-token KL penalty in the reward: PPO with a critic (actor, critic,
    frozen reference, reward model or function), or REINFORCE++ without one."""

    ALGOS: ClassVar[list[str]] = RLHF
    algo: str = "ppo"
    """ppo (actor + critic, GAE), reinforce_pp or reinforce_pp_baseline (no critic)."""
    critic_model: str | None = None
    """Where the critic starts: a reward-model (posttrain rm) or causal-LM directory; none =
    the reward model when the reward is a single rm:DIR term, else the policy's weights with
    a fresh value head."""
    critic_lr: float = 1e-4
    """Learning rate of the critic (its own AdamW)."""
    critic_warmup_steps: int = 0
    """First steps that train the critic only, leaving the actor as it is."""
    value_clip: float | None = None
    """Override ε_v of the clipped value loss (0.2); 0 = unclipped."""
    value_coef: float | None = None
    """Override c_v, the weight of the value loss (0.5). The critic has its own AdamW, which
    is nearly blind to a loss scale, so c_v acts mainly through gradient clipping;
    critic_lr is the knob that matters."""
    prompts_per_step: int = 32
    group_size: int = 4
    minibatch_size: int = 64
    micro_batch_size: int = 64
    ppo_epochs: int = 2
    lr: float = 5e-5

    def validate(self) -> None:
        super().validate()
        _check(self.critic_lr > 0 and self.critic_warmup_steps >= 0,
               "critic_lr must be > 0 and critic_warmup_steps ≥ 0")
        _check(self.critic_warmup_steps == 0 or self.algorithm().critic,
               f"critic_warmup_steps needs a critic; {self.algo} has none")
        _check((self.value_clip is None or self.value_clip >= 0)
               and (self.value_coef is None or self.value_coef > 0),
               "value_clip must be ≥ 0 and value_coef > 0")

    def _overrides(self) -> dict:
        out = super()._overrides()
        if self.value_coef is not None:
            out["value_coef"] = self.value_coef
        if self.value_clip is not None:
            out["value_clip"] = self.value_clip or None  # 0: the plain ½(V - R)²
        return out


@dataclass
class Experience:
    """One step's scored samples, ready for updates."""

    rollout: Rollout
    scores: torch.Tensor  # (N,) total reward used for advantages
    terms: dict[str, torch.Tensor]  # per reward term (N,)
    valid: torch.Tensor  # (N,) False for samples skipped on a reward error
    correct: torch.Tensor  # (N,) bool: task accuracy (see RLTrainer._correct)
    rounds: int
    dropped_groups: int




class TokenBatch:
    """A step's samples in the completion layout: every per-token tensor is ``(N, Lc)``, one
    column per generated token (masks, advantages, old and reference log-probs).

    With ``share_prompt`` each group's prompt is run once and its keys and values are shared
    by the group's completions (:func:`shared_prompt_logprobs`); otherwise each sample is a
    full prompt + completion sequence.

    ``activations`` are the rollout's saved linear-layer outputs (shared-prompt layout only),
    taken over from the rollout (which no longer holds them, so that they are freed as soon
    as they are used up): while the policy is unchanged since sampling, its passes with
    ``replay=True`` take them instead of recomputing (:func:`modeling.replay_forward`).
    The pass that precedes a change of the policy releases them (``last_replay``).
    """

    def __init__(self, rollout: Rollout, pad_id: int, device, share_prompt: bool):
        self.share = share_prompt
        self.activations = rollout.activations if share_prompt else None
        rollout.activations = None
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
            self.packed = None  # decided per model, once for the whole batch (_packed_for)
        else:
            completions = [r[m.bool()].tolist() for r, m in
                           zip(rollout.completion_ids, rollout.completion_mask, strict=True)]
            full = data_mod.pad_sequences(rollout.prompt_ids, completions, pad_id)
            self.full = {k: v.to(device) for k, v in full.items()}
            self.prompt_lengths = torch.tensor([len(p) for p in rollout.prompt_ids],
                                               device=device)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def _packed_for(self, model) -> bool:
        """One packing decision for the whole batch (see :func:`shared_prompt_logprobs`), so
        the old, reference, critic and update passes all take the same path and the first
        update's ratio is exactly 1 in any precision. A packed call replays nothing, so the
        sampler's saved outputs are dropped then."""
        if self.packed is None:
            self.packed = packing_pays(model, self.prompt_mask, self.completion_mask,
                                     self.prompt_index)
            if self.packed:
                self.activations = None
        return self.packed

    def _shared(self, model, rows: torch.Tensor) -> tuple[tuple, dict]:
        """Arguments of :func:`shared_prompt_logprobs`/:func:`shared_prompt_hidden` for the
        completions ``rows``: the prompts they use, renumbered, and the batch's packing."""
        groups, index = torch.unique(self.prompt_index[rows], return_inverse=True)
        args = (self.prompt_ids[groups], self.prompt_mask[groups], self.completion_ids[rows],
                self.completion_mask[rows])
        return args, {"prompt_index": index, "packed": self._packed_for(model)}

    def logprobs(self, model, rows: torch.Tensor, with_entropy: bool = False,
                 replay: bool = False, last_replay: bool = False):
        """Log-probs (and entropy) of the completions of ``rows``, ``(len(rows), Lc)``.
        ``replay``: ``model`` is the policy that sampled the rollout, unchanged since; its
        saved linear-layer outputs are used if there are any. ``last_replay``: and this is
        their last use, so they are released first (what the backward does not need of them
        is freed layer by layer during the forward)."""
        if self.share:
            args, kw = self._shared(model, rows)
            if replay and self.activations is not None:
                saved = self.activations
                if last_replay:
                    self.activations = None
                kw["replay"] = saved.rows(rows).replay_map(model,
                                                               self.completion_ids.shape[1])
                del saved
            return shared_prompt_logprobs(model, *args, with_entropy=with_entropy, **kw)
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

    def values(self, critic, rows: torch.Tensor) -> torch.Tensor:
        """The critic's ``V(x, y_<t)`` for each completion token of ``rows``,
        ``(len(rows), Lc)``: its value head on the hidden state that precedes the token (the
        state the policy acts in), 0 where the mask is 0."""
        mask = self.completion_mask[rows]
        if self.share:
            args, kw = self._shared(critic, rows)
            hidden = shared_prompt_hidden(critic, *args, **kw)
        else:
            hidden = completion_hidden(critic, self.full["input_ids"][rows],
                                       self.full["attention_mask"][rows],
                                       self.full["loss_mask"][rows])
        v = value_head(critic)(hidden).squeeze(-1).float()  # (N,)
        target = mask.bool()
        return torch.zeros(target.shape, dtype=v.dtype, device=v.device).masked_scatter(target, v)


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
        # the last micro-batch is the sampler's outputs' last use: the optimizer step that
        # follows changes the policy
        lp, ent = tokens.logprobs(policy, mb, with_entropy=True, replay=True,
                                  last_replay=i + micro_batch_size >= len(rows))
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


def accumulate_value_gradient(critic, algo: Algorithm, tokens: TokenBatch, mask: torch.Tensor,
                              idx: torch.Tensor, old_values: torch.Tensor,
                              returns: torch.Tensor, live: torch.Tensor,
                              micro_batch_size: int) -> dict[str, float]:
    """Backward ``c_v ·`` the clipped value loss of the minibatch ``idx`` in micro-batches, a
    token mean normalised over the whole minibatch (so the gradient does not depend on
    ``micro_batch_size``). Returns the loss sum and metric means over micro-batches."""
    norm = step_normalizer(mask[idx], "token_mean")
    rows = idx[live[idx]]
    sums: dict[str, float] = {"value_loss": 0.0, "value_clip_frac": 0.0}
    for i in range(0, len(rows), micro_batch_size):
        mb = rows[i:i + micro_batch_size]
        v = tokens.values(critic, mb)
        loss_tok, m = value_loss(v, old_values[mb], returns[mb], mask[mb], algo.value_clip)
        loss = aggregate_loss(loss_tok, mask[mb], "token_mean", norm)
        (algo.value_coef * loss).backward()
        sums["value_loss"] += float(loss.detach())
        # token-weighted, so the metric does not depend on the micro-batch split either
        sums["value_clip_frac"] += float(m["value_clip_frac"] * mask[mb].sum() / norm)
    return sums


class RLTrainer:
    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self.algo = cfg.algorithm()
        self.out_dir = Path(cfg.output_dir or f"runs/{cfg.algo}")
        self.tok = load_tokenizer(cfg.model, cfg.trust_remote_code)
        resume = Path(cfg.resume_from) if cfg.resume_from else None
        if resume is not None and not (resume / "trainer_state.json").exists():
            raise FileNotFoundError(f"resume_from={resume}: not a checkpoint directory "
                                    "(no trainer_state.json)")
        self.policy = load_causal_lm(str(resume or cfg.model), cfg.dtype, cfg.device,
                                     cfg.trust_remote_code)
        self.device = next(self.policy.parameters()).device
        share = cfg.share_prompt
        if share is None:
            # a group's prompt is shared by its G completions, so with G > 1 the shared
            # layout saves (G - 1) prompts' worth of every pass (measured on 2 CPU cores,
            # built-in model and task: 121 → 74 ms/step at G = 8, 123 → 95 at G = 2)
            share = cfg.group_size > 1 or (sum(p.numel() for p in self.policy.parameters())
                                           >= SHARE_PROMPT_MIN_PARAMS)
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
        self.critic = None
        if self.algo.critic:
            seed_everything(cfg.seed)  # a fresh value head is drawn from the global generator
            source = self._critic_source()
            self.critic = load_reward_model(str(resume / "critic") if resume else source,
                                            self.tok, cfg.dtype, cfg.device,
                                            cfg.trust_remote_code)
            value_head(self.critic)  # fail now, not after the first rollout
            log.info("critic from %s", resume / "critic" if resume else source)
        self.kl_ctl = (AdaptiveKLController(self.algo.reward_kl_coef, cfg.kl_target,
                                            cfg.kl_horizon) if cfg.kl_target > 0
                       else FixedKLController(self.algo.reward_kl_coef))
        self.score_moments = RunningMoments()
        self.step_num = 0
        stop = tuple(s for s in (cfg.stop or "").split(",") if s)
        self.params = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k,
                                     cfg.max_new_tokens, stop)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self._order: list[int] = []
        self.compiled = compile_models(cfg, [self.policy, self.ref, self.critic], self.device)
        # whether the last batch's shared-prompt passes were packed into one call, which
        # takes no replay (so the next rollout need not capture): batches are alike
        self.packed = False
        self.reuse_rollout_forward = (cfg.reuse_rollout_forward and self.share_prompt
                                      and not self.compiled and can_replay(self.policy))

    def _critic_source(self) -> str:
        cfg = self.cfg
        if getattr(cfg, "critic_model", None):
            return cfg.critic_model
        models = [t.name[3:] for t in self.rewards if t.name.startswith("rm:")]
        if len(self.rewards) == 1 and models:
            rm_tok = getattr(self.rewards[0].fn, "tokenizer", None)
            if rm_tok is not None and rm_tok.get_vocab() != self.tok.get_vocab():
                log.warning("the reward model %s has another vocabulary than the policy, so it "
                            "cannot read the policy's tokens as a critic; the critic starts "
                            "from the policy (set critic_model to choose)", models[0])
                return cfg.model
            return models[0]
        return cfg.model

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
        prompts = [r["prompt"] for r in rep]
        total, terms, valid = score(self.rewards, prompts, rollout.texts, columns,
                                    self.cfg.on_reward_error)
        correct = self._correct(prompts, rollout.texts, columns, terms)
        if self.algo.overlong_shaping:
            shaping = overlong_penalty(rollout.lengths, self.cfg.max_new_tokens,
                                       min(self.cfg.overlong_cache, self.cfg.max_new_tokens))
            terms["overlong"] = shaping
            total = total + shaping
        return total, terms, valid, correct

    def _correct(self, prompts, completions, columns, terms) -> torch.Tensor:
        """Task accuracy per sample: on the built-in task its exact-answer check (whatever
        the training reward, e.g. a reward model); otherwise the first reward term ≥ 1."""
        if self.cfg.data is None:
            return torch.tensor(builtin_task.reward(prompts, completions, **columns)) >= 1
        return next(iter(terms.values())).nan_to_num() >= 1

    def collect(self) -> Experience:
        """Sample and score a step's groups (refilling with dynamic sampling)."""
        cfg, want = self.cfg, self.cfg.prompts_per_step
        parts, kept, dropped, rounds = [], 0, 0, 0
        while kept < want and rounds < (cfg.dynamic_sampling_rounds
                                         if self.algo.dynamic_sampling else 1):
            rounds += 1
            rows = self._next_rows(want)
            rollout = generate(self.policy, self.tok, [r["prompt"] for r in rows],
                               cfg.group_size, self.params, self.gen,
                               capture=self.reuse_rollout_forward and not self.packed)
            total, terms, valid, correct = self._score(rows, rollout)
            if self.algo.dynamic_sampling:
                signal = groups_with_signal(total, rollout.group_ids)
                groups = rollout.group_ids[signal].unique()[: want - kept]
                keep = torch.isin(rollout.group_ids, groups).nonzero().squeeze(-1)
                dropped += len(rows) - int(signal.view(-1, cfg.group_size).any(-1).sum())
                rollout = select(rollout, keep)
                total, valid, correct = total[keep], valid[keep], correct[keep]
                terms = {k: v[keep] for k, v in terms.items()}
                kept += len(groups)
            else:
                kept += len(rows)
            parts.append((rollout, total, terms, valid, correct))
        if kept == 0:
            raise RuntimeError(
                f"dynamic sampling found no group with different rewards in {rounds} rounds of "
                f"{want} prompts: every group was all right or all wrong, so the data is too "
                "easy or too hard for this policy (or the reward is constant)")
        rollout = concat([p[0] for p in parts], self.tok.pad_token_id)
        return Experience(rollout, torch.cat([p[1] for p in parts]),
                          {k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]},
                          torch.cat([p[3] for p in parts]), torch.cat([p[4] for p in parts]),
                          rounds, dropped)

    # --- evaluation --------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy decoding on the held-out rows: task accuracy (as in :meth:`_correct`) and
        the mean of the training reward (a reward model's score, say)."""
        if not self.eval_rows:
            return {}
        rows = self.eval_rows
        prompts = [r["prompt"] for r in rows]
        completions = greedy_completions(self.policy, self.tok, prompts,
                                         self.cfg.max_new_tokens, self.cfg.eval_batch_size)
        columns = {k: [r.get(k) for r in rows] for k in rows[0] if k not in ("prompt", "_row")}
        total, terms, valid = score(self.rewards, prompts, completions, columns, "skip")
        correct = self._correct(prompts, completions, columns, terms)
        return {"eval/accuracy": float(correct.float().mean()),
                "eval/mean_reward": float(total[valid].mean()) if valid.any() else float("nan")}

    def _optimizer_step(self, model, opt, name: str) -> dict[str, float]:
        """Clip ``model``'s gradient (when max_grad_norm > 0), step, zero; the norm as a
        metric called ``name``."""
        out = {}
        if self.cfg.max_grad_norm > 0:
            out[name] = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                             self.cfg.max_grad_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    def make_optimizers(self):
        """AdamW for the actor, and for the critic when there is one (else None)."""
        cfg = self.cfg
        opt = adamw(self.policy.parameters(), cfg.lr, cfg.weight_decay)
        critic_opt = None
        if self.critic is not None:
            critic_opt = adamw(self.critic.parameters(), cfg.critic_lr, cfg.weight_decay)
        return opt, critic_opt

    def _shape_scores(self, scores: torch.Tensor, ro: Rollout, valid: torch.Tensor
                      ) -> torch.Tensor:
        """The score the advantages see: minus the missing-EOS penalty, normalised by the
        running moments, clipped."""
        cfg = self.cfg
        scores = scores.float()
        if cfg.missing_eos_penalty:
            scores = scores - cfg.missing_eos_penalty * ro.truncated.float()
        if cfg.reward_normalize:
            self.score_moments.update(scores[valid])
            scores = self.score_moments.normalize(scores)
        if cfg.reward_clip:
            scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
        return scores

    def step(self, opt, critic_opt=None) -> dict[str, float]:
        cfg = self.cfg
        algo = self.algo.replace(reward_kl_coef=self.kl_ctl.value) if self.algo.reward_kl_coef \
            else self.algo
        # the learning-rate schedule runs over RL steps (a function of the step, so a resumed
        # run continues it exactly)
        scale = lr_lambda(cfg.lr_schedule, int(cfg.warmup_ratio * cfg.max_steps),
                          cfg.max_steps)(self.step_num)
        for o, lr in ((opt, cfg.lr), (critic_opt, getattr(cfg, "critic_lr", None))):
            if o is not None:
                for group in o.param_groups:
                    group["lr"] = lr * scale
        self.step_num += 1
        t0 = time.perf_counter()
        exp = self.collect()
        t_gen = time.perf_counter()
        ro = exp.rollout
        tokens = TokenBatch(ro, self.tok.pad_token_id, self.device, self.share_prompt)
        valid = exp.valid.to(self.device)
        mask = tokens.completion_mask.float() * valid[:, None]
        everyone = torch.arange(len(tokens), device=self.device)
        several_updates = cfg.ppo_epochs > 1 or cfg.minibatch_size < len(tokens)
        with torch.no_grad():
            old = (tokens.logprobs(self.policy, everyone, replay=True)
                   if several_updates or algo.reward_kl_coef != 0 else None)
            old_values = (tokens.values(self.critic, everyone) if self.critic is not None
                          else None)
        ref = None
        if self.ref is not None:
            with torch.inference_mode():
                ref = tokens.logprobs(self.ref, everyone)
            ref = ref.clone()
        scores = self._shape_scores(exp.scores, ro, exp.valid).to(self.device)
        # a sample skipped on a reward error becomes a group of its own, so its placeholder
        # score does not move the baseline or the std of the samples it was drawn with
        group_ids = ro.group_ids.clone()
        skipped = ~exp.valid
        group_ids[skipped] = int(group_ids.max()) + 1 + torch.arange(int(skipped.sum()))
        adv, returns = compute_advantages(algo, scores, group_ids.to(self.device), mask,
                                          old, ref, old_values)
        skip = algo.kl_coef == 0 and cfg.skip_zero_advantage and self.critic is None
        live = ((adv != 0).any(-1) if skip else mask.any(-1)) & valid
        t_score = time.perf_counter()
        train_policy = self.step_num > getattr(cfg, "critic_warmup_steps", 0)
        sums: dict[str, float] = {}
        n_steps = n_critic_steps = 0
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(len(adv), generator=self.gen).to(self.device)
            for i in range(0, len(adv), cfg.minibatch_size):
                # in row order: a minibatch of the whole batch is then a view of the saved
                # activations, not a copy
                idx = perm[i:i + cfg.minibatch_size].sort().values
                if not live[idx].any():
                    continue
                m: dict[str, float] = {}
                if train_policy:
                    m.update(accumulate_policy_gradient(
                        self.policy, algo, tokens, mask, idx, adv, old, ref, live,
                        cfg.micro_batch_size, cfg.max_new_tokens))
                    m.update(self._optimizer_step(self.policy, opt, "grad_norm"))
                    n_steps += 1
                if self.critic is not None:
                    m.update(accumulate_value_gradient(self.critic, algo, tokens, mask, idx,
                                                       old_values, returns, live,
                                                       cfg.micro_batch_size))
                    m.update(self._optimizer_step(self.critic, critic_opt, "critic_grad_norm"))
                    n_critic_steps += 1
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
        t_train = time.perf_counter()
        self.packed = bool(self.share_prompt and tokens.packed)
        G = cfg.group_size
        raw = exp.scores[exp.valid] if exp.valid.any() else exp.scores
        n_updates = max(n_steps, n_critic_steps, 1)
        record = {f"train/{k}": v / n_updates for k, v in sums.items()}
        record.update({
            "reward/mean": float(raw.mean()),
            "reward/std": float(raw.std()) if len(raw) > 1 else 0.0,
            **{f"reward/{k}": float(v.nan_to_num().mean()) for k, v in exp.terms.items()},
            "reward/task_accuracy": float(exp.correct[exp.valid].float().mean())
            if exp.valid.any() else 0.0,
            "reward/skipped": int((~exp.valid).sum()),
            "completion/length_mean": float(ro.lengths.float().mean()),
            "completion/length_max": int(ro.lengths.max()),
            "completion/truncated_frac": float(ro.truncated.float().mean()),
            "groups/zero_signal_frac": float((~groups_with_signal(exp.scores, ro.group_ids))
                                             .view(-1, G).all(-1).float().mean()),
            "groups/dropped": exp.dropped_groups, "sampling/rounds": exp.rounds,
            "samples/backward_frac": float(live.float().mean()),
            "optim/steps": n_steps, "optim/lr": opt.param_groups[0]["lr"],
            "time/generate_s": t_gen - t0, "time/score_s": t_score - t_gen,
            "time/train_s": t_train - t_score, "time/step_s": t_train - t0,
            "time/tokens_per_s": float(ro.lengths.sum()) / max(t_gen - t0, 1e-9),
        })
        if cfg.missing_eos_penalty or cfg.reward_normalize or cfg.reward_clip:
            record["reward/shaped_mean"] = float(scores[valid].mean())
        if algo.reward_kl_coef != 0:
            # the penalty's KL, per sequence (what the adaptive controller tracks)
            kl_tok = kl_penalty(old, ref, algo.reward_kl_estimator)
            kl = float(masked_sum(kl_tok, mask, dim=-1)[valid].mean())
            record.update({"kl/seq_mean": kl, "kl/coef": algo.reward_kl_coef,
                           "kl/token_mean": float(masked_mean(kl_tok, mask))})
            if train_policy:  # while the critic warms up the policy is the reference
                self.kl_ctl.update(kl, int(valid.sum()))
        if self.critic is not None:
            record.update({
                "critic/return_mean": float(masked_mean(returns, mask)),
                "critic/value_mean": float(masked_mean(old_values, mask)),
                "critic/explained_variance": float(explained_variance(old_values, returns,
                                                                      mask)),
                "critic/optim_steps": n_critic_steps,
            })
            for k in ("value_loss", "value_clip_frac", "critic_grad_norm"):
                if f"train/{k}" in record:
                    record[f"critic/{k}"] = record.pop(f"train/{k}")
        return record

    # --- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, path: Path, opt, critic_opt) -> None:
        """The actor as a Hugging Face directory at ``path``, the critic in ``path/critic``,
        the optimiser states as safetensors, and the loop state (step, KL coefficient, score
        moments, data order, sampling generator) in ``trainer_state.json``/``rng.safetensors``
        — everything :attr:`RLConfig.resume_from` needs to continue the run."""
        save_model(self.policy, self.tok, path)
        save_optimizer(opt, path / "optimizer")
        if self.critic is not None:
            save_model(self.critic, self.tok, path / "critic")
            save_optimizer(critic_opt, path / "critic_optimizer")
        save_file({"generator": self.gen.get_state()}, str(path / "rng.safetensors"))
        state = {"step": self.step_num, "kl_coef": self.kl_ctl.value,
                 "score_moments": self.score_moments.state_dict(), "order": self._order}
        (path / "trainer_state.json").write_text(json.dumps(state))

    def _restore(self, path: Path, opt, critic_opt) -> None:
        state = json.loads((path / "trainer_state.json").read_text())
        load_optimizer(opt, path / "optimizer")
        if self.critic is not None:
            load_optimizer(critic_opt, path / "critic_optimizer")
        self.gen.set_state(load_file(str(path / "rng.safetensors"))["generator"])
        self.step_num = int(state["step"])
        self.kl_ctl.value = float(state["kl_coef"])
        self.score_moments.load_state_dict(state["score_moments"])
        self._order = [int(i) for i in state["order"]]

    # --- the loop ----------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg = self.cfg
        writer = start_run(cfg, self.out_dir)
        opt, critic_opt = self.make_optimizers()
        if cfg.resume_from:
            self._restore(Path(cfg.resume_from), opt, critic_opt)
            print(f"[{cfg.algo}] resumed from {cfg.resume_from} at step {self.step_num}",
                  flush=True)
        try:
            start = self.evaluate()
            writer.write(self.step_num, start)
            print(json.dumps({"step": self.step_num, **start}), flush=True)
            last: dict[str, float] = {}
            while self.step_num < cfg.max_steps:
                record = self.step(opt, critic_opt)
                step = self.step_num
                if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.max_steps:
                    record.update(self.evaluate())
                writer.write(step, record)
                last.update(record)
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    extra = (f"  kl {record['kl/seq_mean']:.3f}" if "kl/seq_mean" in record
                             else "")
                    print(f"[{cfg.algo}] step {step}/{cfg.max_steps}  reward "
                          f"{record['reward/mean']:.3f}  sample acc "
                          f"{record['reward/task_accuracy']:.3f}{extra}  "
                          f"{record['time/step_s']:.2f} s/step", flush=True)
                if cfg.save_every and step % cfg.save_every == 0 and step != cfg.max_steps:
                    self.save_checkpoint(self.out_dir / f"checkpoint-{step}", opt, critic_opt)
            final = self.evaluate()
            writer.write(cfg.max_steps, final)
            last.update(final)
            save_model(self.policy, self.tok, self.out_dir / "final")
            if self.critic is not None:
                save_model(self.critic, self.tok, self.out_dir / "final" / "critic")
        finally:
            writer.close()
        print(json.dumps({"step": cfg.max_steps, "start/accuracy": start.get("eval/accuracy"),
                          **final}), flush=True)
        return last


def run_rl(cfg: RLConfig) -> dict[str, float]:
    return RLTrainer(cfg).train()
