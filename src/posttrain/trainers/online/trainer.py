"""The on-policy trainer: one loop for every RL algorithm of the table — the critic-free ones
(``posttrain grpo``) and RLHF-PPO with its four models (actor, critic, frozen reference,
reward model or function; ``posttrain ppo``). It reads the algorithm's record and never
branches on its name.

Each step (:meth:`RLTrainer.step`):

1. **experience** — sample G completions for each of ``prompts_per_step`` prompts through the
   rollout engine and score them (:mod:`.experience`: dynamic sampling, overlong shaping,
   missing-EOS penalty, running normalisation, clipping);
2. **passes** — the old log-probs (when a step takes more than one optimiser step, or the
   reward carries a KL penalty), the frozen reference's, the critic's values (:mod:`.batch`);
3. **advantages** with the algorithm's estimator: group statistics, or per-token rewards with
   a KL penalty (fixed or adaptive coefficient) followed by GAE over the critic's values
   (PPO) or discounted returns (REINFORCE++);
4. **update** — ``ppo_epochs`` passes of minibatch steps against the step's normaliser
   (:mod:`.update`); samples whose advantage is zero where that means zero gradient skip
   their forward and backward pass (the normaliser still counts them);
5. the new weights **published** to the sampler side, and the step's **metrics**
   (:mod:`.metrics`).

The learner holds the sampler side (:mod:`.sides`: the rollout engine, the data order, the
reward terms; inline, a thread or a process) only through its messages: it takes each
step's batch, publishes each version's weights and asks for evaluations.

The run loop (:mod:`posttrain.trainers.loop`) schedules the learning rates, logs, evaluates
and checkpoints; this job's state (sampling generator, data order, KL coefficient, score
moments) resumes exactly.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from posttrain import dist, fast
from posttrain.config import ConfigError, PPOConfig, RLConfig
from posttrain.core import AdaptiveKLController, FixedKLController
from posttrain.core.algorithms import compute_advantages
from posttrain.fast import eligibility
from posttrain.fast.cache import track_policy_version
from posttrain.fast.compile import compile_models
from posttrain.models import (
    context_parallel,
    decide_share_prompt,
    load_tokenizer,
    lora,
    routing,
    save_model,
)
from posttrain.rewards import parse_rewards
from posttrain.sharding import compute_device
from posttrain.trainers import loop, trained
from posttrain.trainers.loop.job import Job, StepResult
from posttrain.trainers.loop.optim import Optim
from posttrain.trainers.online.batch import TokenBatch
from posttrain.trainers.online.critic import load_critic
from posttrain.trainers.online.inputs import rl_rows
from posttrain.trainers.online.metrics import logprob_gap, sample_table, step_metrics
from posttrain.trainers.online.shaping import ScoreShaper
from posttrain.trainers.online.sides import sampler_side
from posttrain.trainers.online.update import UpdateInputs, micro_batches, run_updates

log = logging.getLogger(__name__)

__all__ = ["PPOConfig", "RLConfig", "RLTrainer", "run_rl"]


class RLTrainer(Job):
    eval_at_start = True
    progress_keys = (("reward", "reward/mean"), ("sample acc", "reward/task_accuracy"),
                     ("eval acc", "eval/accuracy"), ("kl", "kl/seq_mean"),
                     ("tok/s", "time/tokens_per_s"), ("s/step", "time/step_s"))

    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self.name = cfg.algo
        self.algo = cfg.algorithm()
        resume = loop.start_run(cfg)
        if cfg.prompts_per_step < dist.world_size():
            raise ConfigError(f"prompts_per_step={cfg.prompts_per_step} gives some of the "
                              f"{dist.world_size()} ranks no prompt: each rank samples whole "
                              "groups, so use at least one prompt per rank")
        self.tok = load_tokenizer(cfg.model, cfg.trust_remote_code)
        self.policy = trained.load_trained(cfg, resume, lambda name: trained.load_policy(
            cfg, name, trained=True))
        self.sharded = cfg.parallel == "fsdp"
        self.dealt = False  # (whether this step's rows are dealt from the whole step's: _mine)
        self.device = compute_device(self.policy)
        self.moe = routing.is_moe(self.policy)
        """A mixture-of-experts policy: its passes run whole sequences (the layout routing is
        recorded and replayed in) unless share_prompt is set, and the step logs router/*."""
        if self.moe and dist.context_size() > 1:
            raise ConfigError("context_parallel with a mixture-of-experts policy is not "
                              "supported yet (its routing is recorded per whole sequence)")
        if cfg.routing_replay != "none" and not self.moe:
            raise ConfigError(f"routing_replay={cfg.routing_replay} needs a mixture-of-experts "
                              f"policy; {type(self.policy).__name__} has no router")
        self.share_prompt = (False if (self.moe or cfg.packing or cfg.context_parallel > 1)
                             and cfg.share_prompt is None
                             else decide_share_prompt(cfg.share_prompt, self.policy,
                                                      cfg.group_size))
        try:
            self.router_aux_coef = routing.aux_coef(self.policy, cfg.router_aux_loss_coef)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.routing_replay != "none" and self.share_prompt:
            raise ConfigError("routing_replay needs share_prompt=false (routing is recorded "
                              "and replayed over whole sequences)")
        self.ref = None
        """The frozen reference; None with LoRA (the policy with its adapter off)."""
        if self.algo.needs_reference and not lora.is_adapted(self.policy):
            self.ref = trained.load_policy(cfg, cfg.model).eval().requires_grad_(False)
            context_parallel.enable(self.ref)
        self.train_rows, self.eval_rows = self._rows()
        # episodes: the environment's turn rewards, plus any reward terms given
        self.rewards = parse_rewards(cfg.reward or ("" if cfg.episodic else "builtin"),
                                     cfg.reward_weights, cfg.device, cfg.reward_options())
        for term in self.rewards:  # reward models (rm:DIR) run the same forward speed-ups
            if isinstance(getattr(term.fn, "model", None), torch.nn.Module):
                fast.prepare_model(term.fn.model, cfg.fast)
        self.critic = (load_critic(cfg, self.tok, self.rewards, self.device, resume)
                       if self.algo.critic else None)
        self.kl_ctl = (AdaptiveKLController(self.algo.reward_kl_coef, cfg.kl_target,
                                            cfg.kl_horizon) if cfg.kl_target > 0
                       else FixedKLController(self.algo.reward_kl_coef))
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.shaper = ScoreShaper(cfg)
        self.side = sampler_side(cfg, self.algo, self.policy, self.tok, self.rewards,
                                 self.train_rows, self.gen, self._routing_kept(),
                                 self.sharded)
        """The sampler side (:mod:`.sides`): inline, a producer thread or process."""
        self.correction = cfg.correction()
        self.compiled = compile_models(cfg, [self.policy, self.ref, self.critic], self.device)
        self.policy = trained.shard_trained(cfg, self.policy)
        if self.critic is not None:
            self.critic = trained.shard_trained(cfg, self.critic)
        self.optimizers = self._optimizers()
        self.step_num = 0
        # what the engine keeps for the update to reuse, decided once
        self.reuse = eligibility.plan(cfg, self.policy, self.side.traits,
                                      share_prompt=self.share_prompt, compiled=self.compiled,
                                      sharded=self.sharded)
        self.packed = False
        """Whether the last batch's shared-prompt passes were packed into one call."""
        self.side.keep(self._extras())

    @property
    def engine(self):
        """The sampler side's engine (None in another process), for tests and tools only."""
        return self.side.engine

    @property
    def experience(self):
        """The sampler side's batch maker (None in another process): for tests and tools."""
        return self.side.experience

    def _routing_kept(self) -> frozenset[str]:
        """For a MoE policy with r3 or none, the routing (where the engine records it; with
        none, the rollout's routing is what the trainer's is compared with)."""
        wanted = self.cfg.routing_replay == "r3" or (self.moe
                                                     and self.cfg.routing_replay == "none")
        return frozenset({"routing"} if wanted else ())

    def _extras(self) -> frozenset[str]:
        """What the next rollouts keep: the speed-ups' (:mod:`posttrain.fast.eligibility`)
        and the routing (:meth:`_routing_kept`)."""
        return self.reuse.extras(self.packed) | self._routing_kept()

    def _optimizers(self) -> list[Optim]:
        """The policy's AdamW (its steps move the policy version the sampler cache checks)
        and the critic's."""
        cfg = self.cfg
        rows = cfg.fast and cfg.sparse_embedding_grad
        out = [Optim("policy", self.policy, cfg.lr, cfg.weight_decay, cfg.max_grad_norm,
                     cfg.on_nonfinite, rows)]
        track_policy_version(self.policy, out[0].opt)
        if self.critic is not None:
            out.append(Optim("critic", self.critic, cfg.critic_lr, cfg.weight_decay,
                             cfg.max_grad_norm, cfg.on_nonfinite, rows))
        return out

    def _rows(self) -> tuple[list[dict], list[dict]]:
        return rl_rows(self.cfg, self.tok)

    # --- one step ----------------------------------------------------------------------------
    def step(self, step: int) -> StepResult:
        cfg = self.cfg
        self.step_num = step
        algo = (self.algo.replace(reward_kl_coef=self.kl_ctl.value)
                if self.algo.reward_kl_coef else self.algo)
        # 1. experience, from the sampler side
        exp, produced = self.side.take(step)
        share = self.share_prompt and (exp.rollout.loss_mask is None
                                       or _groups_share_prompts(exp.rollout))
        local, own = self._mine(exp, share)
        if not exp.valid.any():
            log.warning("step %d: every sample's reward failed (on_reward_error=skip): the "
                        "step learns nothing", step)
        t0 = time.perf_counter()
        tokens = self._token_batch(local, own, share, cfg.temperature)
        routed = None  # the policy's routing through the step's passes (MoE)
        if self.moe and tokens is not None and not tokens.share:
            routed = tokens.routing = routing.Routing(self.policy, len(tokens),
                                                      tokens.full["input_ids"].shape[1])
            if local.routing is not None:  # the experts the engine chose while sampling
                routed.load(local.routing)
            elif cfg.routing_replay == "r3":
                raise RuntimeError(f"routing_replay=r3: the {self.side.traits.name} engine "
                                   "recorded no routing")
        sampled_routing = routed is not None and local.routing is not None
        valid = exp.valid.to(self.device)
        mask = exp.rollout.trained_mask.to(self.device).float() * valid[:, None]
        # 2. passes: old log-probs, reference log-probs, old values
        old, ref, old_values = self._passes(algo, tokens, own, mask, sampled_routing)
        t_passes = time.perf_counter()
        # 3. advantages
        scores = self.shaper(exp.scores, exp.rollout, exp.valid).to(self.device)
        samples = exp.rollout.sample_ids  # (a split agent episode: one sample, its rows)
        adv, returns = compute_advantages(
            algo, scores, self._group_ids(exp).to(self.device), mask, old, ref, old_values,
            None if samples is None else samples.to(self.device))
        skip = algo.zero_advantage_zero_gradient and self.critic is None
        live = ((adv != 0).any(-1) if skip else mask.any(-1)) & valid
        # 4. update (the policy waits while the critic warms up)
        train_policy = step > getattr(cfg, "critic_warmup_steps", 0)
        recorded = None if old is not None else (torch.zeros_like(mask),
                                                 torch.zeros_like(valid))
        x = UpdateInputs(mask, adv, old, ref, old_values, returns, live, self._local_of(own, mask),
                         recorded, exp.rollout.logprobs.to(self.device), self.correction,
                         self.router_aux_coef if routed is not None else 0.0)
        critic_opt = self.optimizers[1] if self.critic is not None else None
        if routed is not None:  # r2, r3: through the recorded experts; else compare with them
            tokens.routing_mode = ("replay" if cfg.routing_replay != "none" else
                                   "compare" if (old is None) == sampled_routing
                                   else "observe")
            # the disagreement counted is the rollout's against the trainer's at the same
            # weights where the old pass compared it (else the update's against the old's)
            routed.counting = not (sampled_routing and old is not None)
            routed.collect_logits = bool(self.router_aux_coef)  # (the update's forwards)
        sums, n_steps, n_critic = run_updates(
            self.policy, self.critic, algo, tokens, x,
            self.optimizers[0] if train_policy else None, critic_opt, cfg, self.gen)
        t_update = time.perf_counter()
        if recorded is not None and dist.world_size() > 1:  # every rank's rows
            rows = own.to(self.device)
            recorded = (dist.assemble(recorded[0][rows], rows, len(mask)),
                        dist.assemble(recorded[1][rows].float(), rows, len(mask)).bool())
        # 5. the sampler side gets the new weights; metrics
        t_sync = time.perf_counter()
        checked = self._publish(tokens, n_steps, step)
        t_sync = time.perf_counter() - t_sync
        times = {"generate": exp.generate_s, "reward": exp.reward_s,
                 "passes": t_passes - t0, "update": t_update - t_passes, "sync": t_sync}
        record, kl = step_metrics(cfg, algo, exp, tokens, scores, mask, valid, old, ref,
                                  old_values, returns, live, sums, n_steps, n_critic, times)
        record.update(checked)
        record.update(produced)
        if self.moe and dist.world_size() > 1:  # the router metrics of every rank's rows
            flat = dist.sum_floats(routed.accumulators() if routed is not None else
                                   routing.Routing.no_accumulators(self.policy))
            if routed is not None:
                routed.set_accumulators(flat)
        if routed is not None:
            record.update(routed.metrics())
            routed.close()
            tokens.routing = None
        if old is not None:
            record.update(logprob_gap(old, exp.rollout.logprobs, mask))
        elif recorded[1].any():  # the first update's log-probs, on the rows it computed
            record.update(logprob_gap(recorded[0], exp.rollout.logprobs,
                                      mask * recorded[1][:, None]))
        if kl is not None and train_policy:  # while the critic warms up the policy is the ref
            self.kl_ctl.update(kl, int(valid.sum()))
        return StepResult(values=record, tokens=exp.sampled_tokens,
                          samples=self._sample_table(exp, adv, mask, step))

    def _mine(self, exp, share: bool) -> tuple:
        """This rank's part of the step: ``(local, own)``, the rollout of its rows and their
        indices in the step's samples (all in a world of one). Sharded, context parallel or
        on full sequences, the rows are dealt out by data rank (a context group takes the
        same), balanced by tokens (the update is the same: each row's loss carries the
        minibatch's normaliser); a shared-prompt step under ddp (the sampler's cached
        projections) or an MoE policy (its recorded routing) keeps the rows it sampled."""
        self.dealt = (self.sharded or dist.context_size() > 1
                      or (dist.data_world() > 1 and not share and not self.moe))
        if self.dealt:
            ro = exp.rollout
            costs = (ro.completion_mask.sum(-1) + torch.tensor([len(p) for p in ro.prompt_ids]))
            mine = dist.shard_by_cost(list(range(len(costs))), costs.tolist())
            return ro, torch.tensor(mine, dtype=torch.long)
        return exp.local, exp.own

    def _token_batch(self, local, own: torch.Tensor, share: bool, temperature: float
                     ) -> TokenBatch | None:
        """This rank's samples as a token batch (all in a world of one; other tensors cover
        the whole step's samples). None for a rank left without rows (no gradient to add)."""
        if not (len(own) or self.dealt):
            return None
        return TokenBatch(local, self.tok.pad_token_id, self.device, share, temperature,
                          bool(self.cfg.packing) if self.moe else self.cfg.packing,
                          self.cfg.max_tokens_per_micro_batch)  # (None: automatic)

    def _sample_table(self, exp, adv: torch.Tensor, mask: torch.Tensor, step: int
                      ) -> list[dict] | None:
        """The step's sample table on a ``log_samples_every`` step (main rank), else None."""
        cfg = self.cfg
        if not (cfg.log_samples_every and step % cfg.log_samples_every == 0
                and dist.is_main()):
            return None
        return sample_table(exp, self.tok, adv, mask, cfg.log_samples)

    def _local_of(self, own: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each of the step's rows' index in this rank's token batch, -1 for another
        rank's (sharded, the batch holds every row)."""
        local_of = torch.full((len(mask),), -1, dtype=torch.long, device=self.device)
        own = own.to(self.device)
        local_of[own] = own if self.dealt else torch.arange(len(own), device=self.device)
        return local_of

    def _publish(self, tokens: TokenBatch | None, moved: int, step: int) -> dict[str, float]:
        """Version ``step`` to the sampler side (``moved``: the optimiser steps it took), and
        what the next rollouts keep for the update, which follows this batch's layout (a
        batch packed into one call replays nothing, so the next need not keep the
        projections; batches of a run are alike). Returns the guard's metrics."""
        self.packed = bool(self.share_prompt and tokens is not None and tokens.share
                           and tokens.packed)
        return self.side.publish(step, self.policy, moved, self._extras())

    def _passes(self, algo, tokens: TokenBatch | None, own: torch.Tensor, mask: torch.Tensor,
                sampled_routing: bool = False):
        """Old log-probs (None when the first update's ratio is exactly 1 and no reward KL
        needs them), reference log-probs (None without a reference), old values (None
        without a critic), each ``(N, Lc)`` over the step's samples: this rank computes
        its rows ``own`` (rows of its ``tokens``; None: no rows) and gets the others'.
        MoE: the old pass replays the rollout's routing (r3), records its own (r2), or
        routes freely and compares with the rollout's (``sampled_routing``) or records."""
        cfg = self.cfg
        several_updates = (cfg.ppo_epochs > 1 or cfg.minibatch_size < len(mask)
                           or cfg.routing_replay == "r2")  # (r2 records in the old pass)
        # (asynchronous rollouts: the old log-probs are the proximal policy's, the weights
        # before this batch's first update, so with one update the detached current ones
        # are they, as in the synchronous loop; the behaviour policy enters the correction)
        own = own.to(self.device)
        # the rows of ``tokens`` to compute: sharded, it holds every sample
        rows = own if self.dealt else torch.arange(len(own), device=self.device)

        def whole(model, run):  # one forward, or forwards of at most the token budget;
            if model is None:  # sharded, as many as any rank (extras on one row, discarded)
                return None
            outs = [run(model, r) if len(r) else run(model, rows.new_zeros(1))[:0]
                    for r in micro_batches(rows, max(len(rows), 1), model, tokens)]
            local = torch.cat(outs) if outs else mask.new_zeros((0, mask.shape[1]))
            return dist.assemble(local.float(), own, len(mask))

        with torch.no_grad():
            if tokens is not None and tokens.routing is not None:
                tokens.routing_mode = {"r3": "replay", "r2": "record"}.get(
                    cfg.routing_replay, "compare" if sampled_routing else "record")
            old = (whole(self.policy, lambda m, r: tokens.logprobs(m, r, reuse=True))
                   if several_updates or algo.reward_kl_coef != 0 else None)
            if tokens is not None:
                tokens.routing_mode = None  # (the reference may be the policy, adapter off)
            old_values = whole(self.critic, lambda m, r: tokens.values(m, r))
        ref = None
        if self.algo.needs_reference:
            ref_model = self.ref if self.ref is not None else self.policy
            with torch.inference_mode(), lora.adapter_off(ref_model):
                ref = whole(ref_model, lambda m, r: tokens.logprobs(m, r))
            ref = ref.clone()  # a normal tensor, usable next to autograd tensors
        return old, ref, old_values

    @staticmethod
    def _group_ids(exp) -> torch.Tensor:
        """Group ids for the advantages: a sample skipped on a reward error becomes a group
        of its own, so its placeholder score moves neither the baseline nor the std of the
        samples it was drawn with."""
        group_ids = exp.rollout.group_ids.clone()
        skipped = ~exp.valid
        group_ids[skipped] = int(group_ids.max()) + 1 + torch.arange(int(skipped.sum()))
        return group_ids

    # --- the loop's other questions ----------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy decoding through the run's engine on the held-out rows (each rank its
        share): task accuracy (as in :meth:`ExperienceMaker.correct`) and the mean of the
        training reward."""
        if not self.eval_rows:
            return {}
        # every rank its share, context-parallel groups too (sampling is not split)
        rows = self.eval_rows[dist.rank()::dist.world_size()]
        local = self.side.evaluate(rows)
        n_correct, reward, n_valid = dist.sum_floats(local)
        return {"eval/accuracy": n_correct / len(self.eval_rows),
                "eval/mean_reward": reward / n_valid if n_valid else float("nan")}

    def save(self, path: Path, states: dict | None = None) -> None:
        """The actor as a Hugging Face directory at ``path``, the critic in ``path/critic``."""
        states = states or {}
        save_model(self.policy, self.tok, path, states.get("policy"))
        if self.critic is not None:
            save_model(self.critic, self.tok, path / "critic", states.get("critic"))

    def models(self):
        return {"policy": self.policy, **({"critic": self.critic} if self.critic else {})}

    def state(self):
        """Every rank calls it (torchrun: an asynchronous side gathers its rows)."""
        meta = {"kl_coef": self.kl_ctl.value, "score_moments": self.shaper.moments.state_dict(),
                "packed": self.packed}
        side, tensors = self.side.state(self.step_num)
        meta.update(side)  # (the data order, and the batches made ahead)
        tensors["generator"] = self.gen.get_state()
        return meta, tensors

    def load_state(self, meta, tensors) -> None:
        self.side.load_state(meta, tensors, self.step_num)
        self.gen.set_state(tensors["generator"])
        self.kl_ctl.value = float(meta["kl_coef"])
        self.shaper.moments.load_state_dict(meta["score_moments"])
        # what the next rollouts keep follows the last batch's layout, as it would have in
        # the run that was not interrupted
        self.packed = bool(meta["packed"])
        self.side.keep(self._extras())

    def close(self) -> None:
        self.side.close()

    def train(self) -> dict[str, float]:
        return loop.run(self.cfg, self, self.cfg.max_steps)


def _groups_share_prompts(rollout) -> bool:
    """Whether every group's samples start from the same prompt (an environment's first
    message may differ between the episodes of one row)."""
    first: dict[int, list[int]] = {}
    for g, p in zip(rollout.group_ids.tolist(), rollout.prompt_ids, strict=True):
        if first.setdefault(g, p) != p:
            return False
    return True


def run_rl(cfg: RLConfig) -> dict[str, float]:
    return RLTrainer(cfg).train()
