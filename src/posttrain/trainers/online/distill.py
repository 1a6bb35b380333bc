"""``posttrain distill``: on-policy distillation on the RL loop. Each step the student samples
through the run's engine (any engine), the reward terms score the samples (logged, not
trained on), and the update minimises the per-token divergence between the student's and
the teacher's whole next-token distributions at every sampled position
(:func:`posttrain.core.distill.distill_token_loss`): a token mean over the step's sampled
tokens, in minibatches and micro-batches against the minibatch's token count (so the
gradient depends on neither the micro-batch split nor the ranks). The teacher runs each
micro-batch's sequences once, without gradient; the full-vocabulary logits of both models
are held for one micro-batch at a time. LoRA and torchrun (DDP, FSDP2) work as for the
other RL commands; the engine follows the student after every step, checked by the guard."""

from __future__ import annotations

import time

import torch
from torch.utils.checkpoint import checkpoint

from posttrain import dist, fast
from posttrain.config import ConfigError
from posttrain.config.distill import DistillConfig
from posttrain.core.algorithms import PolicyInputs, compute_advantages, policy_objective
from posttrain.core.distill import distill_token_loss
from posttrain.models import (
    completion_hidden,
    context_parallel,
    has_plain_head,
    head_logits,
    load_tokenizer,
)
from posttrain.models.loading import for_device
from posttrain.models.logprobs import FUSED_HEAD_MIN_ELEMENTS, tempered
from posttrain.trainers import trained
from posttrain.trainers.loop.job import StepResult
from posttrain.trainers.online.batch import TokenBatch
from posttrain.trainers.online.metrics import sample_metrics
from posttrain.trainers.online.trainer import RLTrainer
from posttrain.trainers.online.update import _keep_step, micro_batches


class DistillTrainer(RLTrainer):
    progress_keys = (("kl", "distill/divergence"), ("sample acc", "reward/task_accuracy"),
                     ("eval acc", "eval/accuracy"), ("tok/s", "time/tokens_per_s"),
                     ("s/step", "time/step_s"))

    def __init__(self, cfg: DistillConfig):
        super().__init__(cfg)
        self.name = "distill"
        teacher_tok = load_tokenizer(cfg.teacher, cfg.trust_remote_code)
        if teacher_tok.get_vocab() != self.tok.get_vocab():
            raise ConfigError(f"teacher={cfg.teacher}: its vocabulary differs from the "
                              f"student's ({cfg.model}); distillation compares the two "
                              "distributions token by token, so they must share one")
        self.teacher = trained.load_policy(cfg, cfg.teacher).eval().requires_grad_(False)
        sizes = [m.get_output_embeddings().weight.shape[0]
                 if m.get_output_embeddings() is not None else m.config.vocab_size
                 for m in (self.policy, self.teacher)]
        if sizes[0] != sizes[1]:
            raise ConfigError(f"teacher={cfg.teacher}: its head has {sizes[1]} logits, the "
                              f"student's {sizes[0]}: the two distributions must cover "
                              "the same tokens")
        fast.prepare_model(self.teacher, cfg.fast)
        if dist.context_size() > 1 and not (has_plain_head(self.policy)
                                            and has_plain_head(self.teacher)):
            raise ConfigError("context_parallel distills from hidden states split by columns: "
                              "the student and the teacher need plain output embeddings")
        context_parallel.enable(self.teacher)

    def step(self, step: int) -> StepResult:
        cfg = self.cfg
        self.step_num = step
        exp, produced = self.side.take(step)
        local, own = self._mine(exp, False)  # (whole sequences)
        t0 = time.perf_counter()
        valid = exp.valid.to(self.device)
        mask = exp.rollout.trained_mask.to(self.device).float() * valid[:, None]
        # (a rank left without rows, e.g. by dynamic sampling, has no batch; its optimiser
        # step still joins the sum)
        tokens = self._token_batch(local, own, False, 1.0)
        local_of = self._local_of(own, mask)
        opt = self.optimizers[0]
        n_steps, loss_sum, norm_sum, div_tok = 0, 0.0, 0.0, torch.zeros_like(mask)
        adv = None
        if cfg.reward_coef:
            scores = self.shaper(exp.scores, exp.rollout, exp.valid)
            adv, _ = compute_advantages(self.algo, scores.to(self.device),
                                        self._group_ids(exp).to(self.device), mask)
        behaviour = exp.rollout.logprobs.to(self.device)
        N = len(mask)
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(N, generator=self.gen).to(self.device)
            for i in range(0, N, cfg.minibatch_size):
                idx = perm[i:i + cfg.minibatch_size].sort().values
                n_tokens = float(mask[idx].sum())
                if n_tokens == 0:
                    continue
                loss_sum += self._accumulate(tokens, mask, idx, local_of, n_tokens, div_tok,
                                             adv, behaviour)
                norm_sum += opt.step()
                n_steps += 1
        # every rank's divergence per token (each rank filled its own rows)
        if dist.world_size() > 1:
            if dist.context_rank() != 0:  # (a context-parallel group's ranks: the same rows)
                div_tok.zero_()
            dist.sum_flat(div_tok)
        t_update = time.perf_counter()
        checked = self._publish(tokens, n_steps, step)
        ro = exp.rollout
        record = {
            "distill/divergence": float((div_tok * mask).sum() / mask.sum().clamp(min=1)),
            "train/loss": dist.data_sum([loss_sum])[0] / max(n_steps, 1),
            **sample_metrics(exp),
            "optim/steps": n_steps,
            "time/generate_s": exp.generate_s, "time/update_s": t_update - t0,
            "time/tokens_per_s": float(ro.trained_mask.sum()) / max(exp.generate_s, 1e-9),
            **checked, **produced,
        }
        if n_steps:  # the mean over the step's optimiser steps, as the RL trainer logs it
            record["train/grad_norm"] = norm_sum / n_steps
        samples = self._sample_table(exp, adv if adv is not None else torch.zeros_like(mask),
                                     mask, step)
        per_sample = (div_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        for row in samples or ():
            row["divergence"] = float(per_sample[row["sample"]])
        return StepResult(values=record, tokens=exp.sampled_tokens, samples=samples)

    def _accumulate(self, tokens: TokenBatch, mask: torch.Tensor, idx: torch.Tensor,
                    local_of: torch.Tensor, n_tokens: float, div_tok: torch.Tensor,
                    adv: torch.Tensor | None, behaviour: torch.Tensor) -> float:
        """Backward this rank's share of the minibatch ``idx``'s loss (the token-mean
        divergence, plus ``reward_coef`` times the clipped policy-gradient loss of the
        rewards' advantages), in micro-batches; each position's divergence is written to
        ``div_tok``. Returns this rank's share of the loss."""
        cfg = self.cfg
        rows = idx[local_of[idx] >= 0]
        total = 0.0
        for mb in micro_batches(rows, cfg.micro_batch_size, self.policy, tokens, local_of):
            if not len(mb):
                # (sharded: the batch holds every row, so any row stands in)
                _keep_step(lambda: self._per_token(tokens, idx[:1])[0])
                continue
            where = tokens.completion_mask[local_of[mb]].bool()  # the rows' flat token order
            div, lp = self._per_token(tokens, local_of[mb])
            loss = (div * mask[mb][where]).sum() / n_tokens
            if adv is not None:  # the rewards' term: PPO-clip against the sampling policy
                lp2 = torch.zeros_like(mask[mb]).masked_scatter(where, lp)
                pg, _ = policy_objective(self.algo, PolicyInputs(
                    lp2, behaviour[mb], adv[mb], mask[mb]))
                loss = loss + cfg.reward_coef * (pg * mask[mb]).sum() / n_tokens
            loss.backward()
            total += float(loss.detach())
            div_tok[mb] = torch.zeros_like(div_tok[mb]).masked_scatter(
                where, div.detach().to(div_tok.dtype))
        return total

    def _per_token(self, tokens: TokenBatch, local: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """At each completion token of the rows ``local`` (flat, in row-major order): the
        divergence of the student from the teacher and the student's log-prob of the token
        (at the sampling temperature), both with the student's gradient. With plain heads
        the two models' backbones run once and the heads run in chunks of tokens, each
        chunk's logits recomputed in the backward (:func:`torch.utils.checkpoint`), once the
        logits would reach the fused head's size (``FUSED_HEAD_MIN_ELEMENTS``): the
        vocabulary-sized logits of both models are never held whole. Sharded (FSDP2), the
        heads run whole on the micro-batch. Packed (``tokens.packing``), the rows run
        without padding: the completions' tokens come in the same order."""
        ids, attn, target = (tokens.full[k][local] for k in ("input_ids", "attention_mask",
                                                             "loss_mask"))
        pos = None
        if tokens.packing:
            packed = tokens._pack(local)[0]
            ids, attn, target, pos = (packed["input_ids"], None, packed["loss_mask"],
                                      packed["position_ids"])
        labels = tokens.completion_ids[local][tokens.completion_mask[local].bool()]
        if not (has_plain_head(self.policy) and has_plain_head(self.teacher)):
            with torch.no_grad():
                teacher = self.teacher(input_ids=ids, attention_mask=attn, position_ids=pos,
                                       use_cache=False).logits[:, :-1][target[:, 1:].bool()]
            student = self.policy(input_ids=ids, attention_mask=attn, position_ids=pos,
                                  use_cache=False).logits[:, :-1][target[:, 1:].bool()]
            return self._chunk(student, teacher, labels)
        if context_parallel.active(self.policy):  # each rank its own columns' tokens
            with torch.no_grad():
                h_teacher, split = context_parallel.backbone_hidden(self.teacher, ids, attn, pos)
            h_student, split = context_parallel.backbone_hidden(self.policy, ids, attn, pos)
            local = split.local(target[:, 1:].bool(), False)
            div, lp = self._heads(h_student[local], h_teacher[local],
                                  split.local(ids[:, 1:])[local])
            return tuple(split.gather_rows(x, local, target[:, 1:].bool()) for x in (div, lp))
        with torch.no_grad():
            h_teacher = completion_hidden(self.teacher, ids, attn, target, pos)
        h_student = completion_hidden(self.policy, ids, attn, target, pos)
        return self._heads(h_student, h_teacher, labels)

    def _heads(self, h_student: torch.Tensor, h_teacher: torch.Tensor, labels: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_per_token` from the two models' hidden states at the tokens ``labels``."""
        n, V = len(labels), self.policy.get_output_embeddings().weight.shape[0]
        # sharded: one call of each head per micro-batch, as the RL trainer's log-probs
        # (every rank must make the same FSDP calls, and the token counts differ by rank)
        if self.sharded or n * V < for_device(FUSED_HEAD_MIN_ELEMENTS, h_student.device):
            return self._chunk(head_logits(self.policy, h_student),
                               head_logits(self.teacher, h_teacher), labels)
        size = max(1, self.chunk_elements // V)
        parts = [checkpoint(self._head_chunk, h_student[j:j + size], h_teacher[j:j + size],
                            labels[j:j + size], use_reentrant=False)
                 for j in range(0, n, size)]
        return torch.cat([d for d, _ in parts]), torch.cat([lp for _, lp in parts])

    chunk_elements = 1 << 22
    """Logits per chunk of the chunked head path (16 MiB of float32 per model)."""

    def _head_chunk(self, h_student, h_teacher, labels):
        return self._chunk(head_logits(self.policy, h_student),
                           head_logits(self.teacher, h_teacher), labels)

    def _chunk(self, student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor):
        div = distill_token_loss(student, teacher, self.cfg.beta)
        if not self.cfg.reward_coef:
            return div, torch.zeros_like(div)
        lp = torch.log_softmax(tempered(student.float(), self.cfg.temperature), -1)
        return div, lp.gather(-1, labels[:, None]).squeeze(-1)


def run_distill(cfg: DistillConfig) -> dict[str, float]:
    return DistillTrainer(cfg).train()
