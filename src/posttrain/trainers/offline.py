"""The offline trainers: SFT, Bradley–Terry reward model and DPO.

Each is a config dataclass (defaults for the built-in tiny model and task) and a
:class:`Trainer` subclass that says how to collate, what a loss unit is (a completion token
for SFT, a pair for the reward model and DPO) and the loss summed over units. Everything
else — optimiser, schedule, accumulation, logging, checkpoints — is the shared loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from posttrain import data as data_mod
from posttrain.builtin import task as builtin_task
from posttrain.config import TrainConfig, _check
from posttrain.core import bradley_terry_loss, dpo_loss
from posttrain.core.preference import DPO_LOSS_TYPES
from posttrain.modeling import (
    SHARE_PROMPT_MIN_PARAMS,
    completion_logprobs,
    has_plain_head,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    packs_shared_prompts,
    sequence_scores,
    shared_prompt_logprobs,
)
from posttrain.trainers.base import Trainer, seed_everything

log = logging.getLogger(__name__)


# --- configs ---------------------------------------------------------------------------------

@dataclass
class SFTConfig(TrainConfig):
    """Supervised fine-tuning on prompt/completion or chat data (loss on completions only)."""

    lr: float = 1e-4
    batch_size: int = 32


@dataclass
class RMConfig(TrainConfig):
    """Bradley–Terry reward model on prompt/chosen/rejected pairs."""

    lr: float = 1e-4
    batch_size: int = 16
    epochs: float = 2.0
    center_coef: float = 0.0
    """Weight c of the centring term c·(r_c + r_r)² (0 = off)."""

    def validate(self) -> None:
        super().validate()
        _check(self.center_coef >= 0, "center_coef must be ≥ 0")


@dataclass
class DPOConfig(TrainConfig):
    """Direct preference optimisation against a frozen reference."""

    lr: float = 1e-5
    batch_size: int = 16
    beta: float = 0.1
    """β: strength of the implicit KL constraint."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), robust (cDPO), ipo or hinge."""
    label_smoothing: float = 0.0
    """ε of the robust (cDPO) loss."""
    ref_model: str | None = None
    """Reference policy; none = the starting model."""
    precompute_ref: bool = True
    """Compute the reference log-likelihoods once before training and free the reference."""
    share_prompt: bool | None = None
    """Run each prompt once for both its completions (its keys and values are shared, with
    gradient); false = two full sequences per pair; none = automatic: on when the pair fits
    one packed forward call (sdpa or eager attention), else on from 2M parameters (below
    that a second forward call costs more than it saves)."""

    def validate(self) -> None:
        super().validate()
        _check(self.beta > 0, "beta must be > 0")
        _check(self.loss_type in DPO_LOSS_TYPES,
               f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}")
        _check(0 <= self.label_smoothing < 0.5, "label_smoothing must be in [0, 0.5)")


# --- data ------------------------------------------------------------------------------------

def _splits(cfg: TrainConfig, kind: str, builtin_rows):
    """(name, train rows, eval rows) from files or, with no data given, the built-in task."""
    if cfg.data is None:
        train = builtin_rows(cfg.builtin_train_size, "train", cfg.seed)
        held = builtin_rows(cfg.builtin_eval_size, "eval", cfg.seed)
        source = data_mod.BUILTIN_SOURCE
        return (source, data_mod.validate(source, train, kind),
                source, data_mod.validate(source, held, kind))
    name, train = data_mod.load(cfg.data, kind)
    eval_name, held = (data_mod.load(cfg.eval_data, kind) if cfg.eval_data else (name, []))
    return name, train, eval_name, held


def _pair_batch(examples: list[data_mod.Encoded], pad_id: int, share_prompt: bool = False
                ) -> dict:
    """Chosen rows first, then rejected: ``(2B, T)`` full sequences, or with ``share_prompt``
    the ``(B, Lp)`` prompts and ``(2B, Lc)`` completions."""
    prompts = [e.prompt for e in examples]
    completions = [e.completions[0] for e in examples] + [e.completions[1] for e in examples]
    if share_prompt:
        batch = data_mod.pad_shared_prompts(prompts, completions, pad_id)
    else:
        batch = data_mod.pad_sequences(prompts * 2, completions, pad_id)
    batch["n_pairs"] = len(examples)
    return batch


# --- trainers --------------------------------------------------------------------------------

class SFTTrainer(Trainer):
    command = "sft"
    progress_keys = ("loss", "token_accuracy")

    def collate(self, examples):
        return data_mod.pad_sequences([e.prompt for e in examples],
                                      [e.completions[0] for e in examples],
                                      self.tokenizer.pad_token_id)

    def units(self, batch):
        return int(batch["loss_mask"][:, 1:].sum())

    def loss(self, batch):
        lp = completion_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                 batch["loss_mask"])  # (B, T-1), 0 off the completions
        return -lp.sum(), {}


class RewardTrainer(Trainer):
    command = "rm"
    progress_keys = ("loss", "accuracy")

    def collate(self, examples):
        batch = _pair_batch(examples, self.tokenizer.pad_token_id)
        margins = [e.margin or 0.0 for e in examples]
        batch["margin"] = torch.tensor(margins) if any(margins) else None
        return batch

    def units(self, batch):
        return batch["n_pairs"]

    def loss(self, batch):
        n = batch["n_pairs"]
        scores = sequence_scores(self.model, batch["input_ids"], batch["attention_mask"])
        loss, m = bradley_terry_loss(scores[:n], scores[n:], batch["margin"],
                                     self.cfg.center_coef)
        return loss.sum(), {"accuracy": m["accuracy"] * n, "margin": m["margin"] * n}


class DPOTrainer(Trainer):
    command = "dpo"
    progress_keys = ("loss", "reward_accuracy")

    def __init__(self, cfg, model, tokenizer, train_examples, eval_examples, ref_model):
        super().__init__(cfg, model, tokenizer, train_examples, eval_examples)
        self.ref_model = ref_model.eval().requires_grad_(False)
        share = cfg.share_prompt
        if share is None:
            share = (packs_shared_prompts(model)
                     or sum(p.numel() for p in model.parameters()) >= SHARE_PROMPT_MIN_PARAMS)
        self.share_prompt = share and has_plain_head(model)
        if cfg.precompute_ref:
            for examples in (self.train_examples, self.eval_examples):
                self._cache_reference(examples)
            self.ref_model = None  # the cache replaces it: free the memory

    @torch.no_grad()
    def _cache_reference(self, examples):
        for i in range(0, len(examples), self.cfg.eval_batch_size):
            chunk = examples[i:i + self.cfg.eval_batch_size]
            batch = self.to_device(self.collate(chunk, with_ref=False))
            ref = self._sequence_logps(self.ref_model, batch).cpu()
            for j, e in enumerate(chunk):
                e.ref_logps = (float(ref[j]), float(ref[len(chunk) + j]))

    @staticmethod
    def _sequence_logps(model, batch) -> torch.Tensor:
        if "prompt_ids" in batch:
            lp = shared_prompt_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                        batch["completion_ids"], batch["completion_mask"])
        else:
            lp = completion_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                     batch["loss_mask"])
        return lp.sum(-1)  # (2B,)

    @staticmethod
    def _lengths(batch) -> torch.Tensor:
        if "completion_mask" in batch:
            return batch["completion_mask"].sum(-1)
        return batch["loss_mask"][:, 1:].sum(-1)

    def collate(self, examples, with_ref: bool = True):
        batch = _pair_batch(examples, self.tokenizer.pad_token_id, self.share_prompt)
        if with_ref and self.cfg.precompute_ref:
            batch["ref_logps"] = torch.tensor([e.ref_logps[0] for e in examples]
                                              + [e.ref_logps[1] for e in examples])
        return batch

    def units(self, batch):
        return batch["n_pairs"]

    def loss(self, batch):
        n = batch["n_pairs"]
        logps = self._sequence_logps(self.model, batch)
        if "ref_logps" in batch:
            ref = batch["ref_logps"].to(logps.dtype)
        else:
            with torch.inference_mode():
                ref = self._sequence_logps(self.ref_model, batch)
            ref = ref.clone()  # a normal tensor, usable next to autograd tensors
        lengths = self._lengths(batch)
        loss, m = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], self.cfg.beta,
                           self.cfg.loss_type, self.cfg.label_smoothing,
                           chosen_lengths=lengths[:n], rejected_lengths=lengths[n:])
        return loss.sum(), {k: v * n for k, v in m.items()}


# --- entry points ----------------------------------------------------------------------------

def _encode(cfg, tokenizer, kind):
    rows_fn = builtin_task.sft_rows if kind == "sft" else builtin_task.preference_rows
    name, train, eval_name, held = _splits(cfg, kind, rows_fn)
    enc = data_mod.encode_sft if kind == "sft" else data_mod.encode_pairs
    train_ex = enc(tokenizer, name, train, cfg.max_length, cfg.overlong)
    eval_ex = enc(tokenizer, eval_name, held, cfg.max_length, cfg.overlong) if held else []
    if not train_ex:
        raise data_mod.DataError(name, None, None, "no rows left after the over-long policy")
    return train_ex, eval_ex


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    train_ex, eval_ex = _encode(cfg, tokenizer, "sft")
    model = load_causal_lm(cfg.model, cfg.dtype, cfg.device, cfg.trust_remote_code)
    return SFTTrainer(cfg, model, tokenizer, train_ex, eval_ex).train()


def run_rm(cfg: RMConfig) -> dict[str, float]:
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    train_ex, eval_ex = _encode(cfg, tokenizer, "preference")
    seed_everything(cfg.seed)  # the fresh scalar head is drawn from torch's global generator
    model = load_reward_model(cfg.model, tokenizer, cfg.dtype, cfg.device, cfg.trust_remote_code)
    return RewardTrainer(cfg, model, tokenizer, train_ex, eval_ex).train()


def run_dpo(cfg: DPOConfig) -> dict[str, float]:
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    train_ex, eval_ex = _encode(cfg, tokenizer, "preference")
    model = load_causal_lm(cfg.model, cfg.dtype, cfg.device, cfg.trust_remote_code)
    ref = load_causal_lm(cfg.ref_model or cfg.model, cfg.dtype, cfg.device,
                         cfg.trust_remote_code)
    return DPOTrainer(cfg, model, tokenizer, train_ex, eval_ex, ref).train()
