"""The offline trainers: SFT, Bradley–Terry reward model and DPO, as jobs of the run loop.

Each says how to collate examples, what a loss unit is (a completion token for SFT, a pair
for the reward model and DPO) and its loss as a *sum* over those units. :class:`OfflineJob`
divides by the unit count of the whole optimiser step, so the gradient does not depend on how
the step is cut into micro-batches; the run loop (:mod:`.loop`) does everything else.
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain import data as data_mod
from posttrain import dist, fast, packing, sharding
from posttrain.builtin import task as builtin_task
from posttrain.config import ConfigError, DPOConfig, OfflineConfig, RMConfig, SFTConfig
from posttrain.core import bradley_terry_loss, dpo_loss
from posttrain.fast.compile import compile_models
from posttrain.models import (
    completion_logprobs,
    context_parallel,
    decide_share_prompt,
    load_reward_model,
    load_tokenizer,
    lora,
    pick_device,
    routing,
    save_model,
    sequence_scores,
    shared_prompt_logprobs,
)
from posttrain.sharding import compute_device
from posttrain.trainers import loop, trained
from posttrain.trainers.loop import Job, Optim, StepResult
from posttrain.trainers.order import ExampleStream

# --- data ------------------------------------------------------------------------------------

def _splits(cfg: OfflineConfig, kind: str, builtin_rows):
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

def _completion_tokens(batch: dict) -> int:
    """The completion tokens of a collated batch (a pair's: both completions)."""
    for key in ("loss_mask", "completion_mask"):
        if key in batch:
            return int(batch[key].sum())
    return int(batch["attention_mask"].sum())


def _pair_batch(examples: list[data_mod.Encoded], pad_id: int, share_prompt: bool = False,
                packing: bool = False, budget: int | None = None) -> dict:
    """Chosen rows first, then rejected: ``(2B, T)`` full sequences, or with ``share_prompt``
    the ``(B, Lp)`` prompts and ``(2B, Lc)`` completions, or with ``packing`` packed rows
    (a pair's two sequences in one row; per-sequence results read back in that order)."""
    prompts = [e.prompt for e in examples]
    completions = [e.completions[0] for e in examples] + [e.completions[1] for e in examples]
    B = len(examples)
    if packing:
        batch = data_mod.pack_sequences(prompts * 2, completions, pad_id, budget=budget,
                                        together=[[i, B + i] for i in range(B)])
    elif share_prompt:
        batch = data_mod.pad_shared_prompts(prompts, completions, pad_id)
    else:
        batch = data_mod.pad_sequences(prompts * 2, completions, pad_id)
    batch["n_pairs"] = len(examples)
    return batch


# --- jobs ------------------------------------------------------------------------------------

class OfflineJob(Job):
    """One optimiser step over ``grad_accum`` micro-batches of ``batch_size`` examples. A
    subclass provides ``collate``, ``units`` and ``loss``."""

    def __init__(self, cfg: OfflineConfig, model, tokenizer, train_examples: list,
                 eval_examples: list):
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.train_examples, self.eval_examples = train_examples, eval_examples
        self.device = compute_device(model)
        self.name = cfg.COMMAND
        self.stream = ExampleStream(len(train_examples), cfg.seed)
        if cfg.batch_size % dist.data_world():
            raise ConfigError(f"batch_size {cfg.batch_size} is global: it must be a multiple of "
                              f"the {dist.data_world()} data-parallel ranks")
        self.optimizers = [Optim("model", model, cfg.lr, cfg.weight_decay, cfg.max_grad_norm,
                                 cfg.on_nonfinite, cfg.fast and cfg.sparse_embedding_grad)]
        try:  # mixture-of-experts models: the family's load-balancing loss, if weighted
            self.aux_coef = routing.aux_coef(model, cfg.router_aux_loss_coef)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.aux_coef and dist.context_size() > 1:
            raise ConfigError("router_aux_loss_coef with context_parallel is not supported yet "
                              "(the load-balancing loss counts each forward's own tokens)")
        self.packing, self.budget = self._decide_packing()
        self.forward_tokens = cfg.max_tokens_per_micro_batch if self.packing else None
        """Packing with ``max_tokens_per_micro_batch`` N: each forward is one packed row of
        at most N tokens (:meth:`_forwards`), cut from the whole step's examples."""

    sequences_per_example = 1  # (a preference pair's 2 share a packed row)

    def shares_prompts(self) -> bool:
        """Whether ``share_prompt`` left automatic takes the shared layout (DPO)."""
        return False

    def _decide_packing(self) -> tuple[bool, int | None]:
        """``--packing`` as set, or automatic: from the lengths of the run's first
        micro-batches in its own order (:func:`posttrain.packing.decide_packing`); off where
        another layout is chosen (shared prompts, a load-balancing loss)."""
        cfg = self.cfg
        setting = (False if cfg.packing is None and (getattr(cfg, "share_prompt", None)
                                                     or self.aux_coef or self.shares_prompts())
                   else cfg.packing)
        groups = [self._sequence_lengths(e) for e in self.train_examples]
        return packing.decide_for_data(cfg.COMMAND, setting, cfg.packing is None,
                                       cfg.max_tokens_per_micro_batch, groups,
                                       ExampleStream(len(groups), cfg.seed), cfg.batch_size)

    # --- what a subclass provides ------------------------------------------------------------
    def collate(self, examples: list) -> dict:
        raise NotImplementedError

    def units(self, batch: dict) -> int:
        """Loss units (tokens, pairs) in a micro-batch: the step normaliser sums these."""
        raise NotImplementedError

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss summed over the batch's units, and metric sums over the same units."""
        raise NotImplementedError

    # --- the job -----------------------------------------------------------------------------
    def to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    def _sequence_lengths(self, example) -> list[int]:
        """The tokens of each of an example's sequences (prompt and completion), which
        share a packed row."""
        return [len(example.prompt) + len(c)
                for c in example.completions[:self.sequences_per_example]]

    def _forwards(self, examples: list, batch_size: int) -> list[list]:
        """``examples`` as the forwards that run them: ``batch_size`` at a time, or with
        :attr:`forward_tokens` N runs of examples of at most N tokens in all (one packed
        row each; an example longer than N alone)."""
        if self.forward_tokens is None:
            return [examples[i:i + batch_size] for i in range(0, len(examples), batch_size)]
        rows = data_mod.packed_rows([sum(self._sequence_lengths(e)) for e in examples],
                                    self.forward_tokens)
        return [[examples[i] for i in row] for row in rows]

    def batches(self, examples: list, batch_size: int):
        for chunk in self._forwards(examples, batch_size):
            yield self.to_device(self.collate(chunk))

    def step(self, step: int) -> StepResult:
        """One optimiser step over ``grad_accum`` micro-batches of ``batch_size`` examples
        (with a token budget, the step's examples in forwards of at most N tokens). Under
        torchrun each rank takes its share of every micro-batch (all ranks draw the same
        order); the loss is normalised by the units of the whole step across ranks and
        the gradients are summed across ranks (in :class:`Optim`), so the update is the one
        a single process computes."""
        cfg = self.cfg
        self.model.train()
        drawn = [[self.train_examples[next(self.stream)] for _ in range(cfg.batch_size)]
                 for _ in range(cfg.grad_accum)]
        if self.forward_tokens is None:
            micro = [self.to_device(self.collate(self._mine(mb))) for mb in drawn]
        else:  # the step's share of this rank, in forwards of at most N tokens
            micro = list(self.batches(self._mine([e for mb in drawn for e in mb]), cfg.batch_size))
        # sharded (FSDP2), every forward is a collective: the ranks run as many, a rank with
        # fewer the rest after its own (one example, zero weight), past the sum below
        extra = sharding.lockstep(len(micro), self.model) - len(micro)
        step_units, tokens = dist.data_sum([sum(self.units(b) for b in micro),
                                              sum(_completion_tokens(b) for b in micro)])
        sums: dict[str, torch.Tensor] = {}
        for batch in micro:
            if self.aux_coef:  # added per unit, so the step's weight is units-weighted
                with routing.RouterLosses(self.model) as router:
                    loss_sum, metric_sums = self.loss(batch)
                    aux = router.loss()
                if aux is not None:
                    units = self.units(batch)
                    loss_sum = loss_sum + self.aux_coef * aux * units
                    metric_sums = {**metric_sums, "router_aux_loss": aux.detach() * units}
            else:
                loss_sum, metric_sums = self.loss(batch)
            (loss_sum / max(step_units, 1)).backward()
            for k, v in {"loss": loss_sum.detach(), **metric_sums}.items():
                sums[f"train/{k}"] = sums.get(f"train/{k}", 0.0) + v.detach()
        for _ in range(extra):
            (self.loss(self.to_device(self.collate(drawn[0][:1])))[0] * 0).backward()
        norm = self.optimizers[0].step()
        keys = sorted(sums)
        totals = dist.data_sum([float(sums[k]) for k in keys])
        return StepResult(dict(zip(keys, totals, strict=True)), step_units,
                          {"train/grad_norm": norm}, tokens=int(tokens))

    def _mine(self, examples: list) -> list:
        """This rank's share of a micro-batch (with a token budget, of the step): every
        world-th example, or with packing the share balanced by tokens (the ranks' packed
        rows end up alike, so they finish together; the update is the same: the loss is
        normalised by the step's units)."""
        if not self.packing:
            return dist.shard(examples)
        return dist.shard_by_cost(examples, [sum(self._sequence_lengths(e)) for e in examples])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Unit-weighted means of the loss and metrics over the held-out examples."""
        if not self.eval_examples:
            return {}
        was_training = self.model.training
        self.model.eval()
        total, sums = 0, {"loss": 0.0}
        batches = list(self.batches(dist.shard(self.eval_examples), self.cfg.eval_batch_size))
        # sharded: every rank runs as many forwards as the rank with the most batches (the
        # extra ones, on one example, are discarded)
        for _ in range(sharding.lockstep(len(batches), self.model) - len(batches)):
            self.loss(self.to_device(self.collate(self.eval_examples[:1])))
        for batch in batches:
            loss_sum, metric_sums = self.loss(batch)
            total += self.units(batch)
            for k, v in {"loss": loss_sum, **metric_sums}.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        self.model.train(was_training)
        keys = sorted(sums)
        *values, total = dist.data_sum([sums[k] for k in keys] + [total])
        return {f"eval/{k}": v / max(total, 1) for k, v in zip(keys, values, strict=True)}

    def save(self, path: Path, states: dict | None = None) -> None:
        save_model(self.model, self.tokenizer, path, (states or {}).get("model"))

    def models(self):
        return {"model": self.model}

    def state(self):
        return {"drawn": self.stream.drawn}, {}

    def load_state(self, meta, tensors) -> None:
        self.stream = ExampleStream(len(self.train_examples), self.cfg.seed, meta["drawn"])

    def train(self) -> dict[str, float]:
        """Run this job in the run loop."""
        return loop.run(self.cfg, self, self.cfg.total_steps(len(self.train_examples)))


class SFTTrainer(OfflineJob):
    progress_keys = (("loss", "train/loss"), ("token acc", "train/token_accuracy"))

    def collate(self, examples):
        args = ([e.prompt for e in examples], [e.completions[0] for e in examples],
                self.tokenizer.pad_token_id, [e.trained[0] if e.trained else None
                                              for e in examples])
        if self.packing:  # (rows without padding; positions restart per example)
            return data_mod.pack_sequences(*args, budget=self.budget)
        return data_mod.pad_sequences(*args)

    def units(self, batch):
        return int(batch["loss_mask"][:, 1:].sum())

    def loss(self, batch):
        lp = completion_logprobs(self.model, batch["input_ids"], batch.get("attention_mask"),
                                 batch["loss_mask"], position_ids=batch.get("position_ids")
                                 )  # (rows, T-1), 0 off the completions
        return -lp.sum(), {}


class RewardTrainer(OfflineJob):
    sequences_per_example = 2
    progress_keys = (("loss", "train/loss"), ("acc", "train/accuracy"))

    def collate(self, examples):
        batch = _pair_batch(examples, self.tokenizer.pad_token_id, packing=self.packing,
                            budget=self.budget)
        margins = [e.margin or 0.0 for e in examples]
        batch["margin"] = torch.tensor(margins) if any(margins) else None
        return batch

    def units(self, batch):
        return batch["n_pairs"]

    def loss(self, batch):
        n = batch["n_pairs"]
        scores = sequence_scores(self.model, batch["input_ids"], batch.get("attention_mask"),
                                 batch.get("position_ids"), batch.get("ends"))
        loss, m = bradley_terry_loss(scores[:n], scores[n:], batch["margin"],
                                     self.cfg.center_coef)
        return loss.sum(), {"accuracy": m["accuracy"] * n, "margin": m["margin"] * n}


class DPOTrainer(OfflineJob):
    sequences_per_example = 2
    progress_keys = (("loss", "train/loss"), ("reward acc", "train/reward_accuracy"))

    def shares_prompts(self) -> bool:  # (left automatic: where it pays)
        return (self.cfg.share_prompt is None and self.cfg.context_parallel <= 1
                and decide_share_prompt(None, self.model))

    def __init__(self, cfg, model, tokenizer, train_examples, eval_examples, ref_model):
        super().__init__(cfg, model, tokenizer, train_examples, eval_examples)
        self.ref_model = None if ref_model is None else ref_model.eval().requires_grad_(False)
        """The frozen reference; None: the policy with its adapter off (LoRA)."""
        if self.aux_coef and cfg.share_prompt:
            raise ConfigError("router_aux_loss_coef needs share_prompt=false (the shared "
                              "prompt's packed mask hides which tokens the loss counts)")
        # (the auxiliary loss reads each forward's padding: full sequences)
        self.share_prompt = (False if (self.aux_coef or self.packing or cfg.context_parallel > 1)
                             and cfg.share_prompt is None
                             else decide_share_prompt(cfg.share_prompt, model))
        context_parallel.enable(self.ref_model)
        if cfg.precompute_ref:
            for examples in (self.train_examples, self.eval_examples):
                self._cache_reference(examples)
            self.ref_model = None  # the cache replaces it: free the memory

    @torch.no_grad()
    def _cache_reference(self, examples):
        for chunk in self._forwards(examples, self.cfg.eval_batch_size):
            batch = self.to_device(self.collate(chunk, with_ref=False))
            ref = self._reference_logps(batch).cpu()
            for j, e in enumerate(chunk):
                e.ref_logps = (float(ref[j]), float(ref[len(chunk) + j]))

    def _reference_logps(self, batch) -> torch.Tensor:
        if self.ref_model is not None:
            return self._sequence_logps(self.ref_model, batch)
        with lora.adapter_off(self.model):
            return self._sequence_logps(self.model, batch)

    @staticmethod
    def _sequence_logps(model, batch) -> torch.Tensor:
        if "prompt_ids" in batch:
            lp = shared_prompt_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                        batch["completion_ids"], batch["completion_mask"])
        elif "sequence_ids" in batch:  # packed rows: sums by sequence, chosen then rejected
            lp = completion_logprobs(model, batch["input_ids"], None, batch["loss_mask"],
                                     position_ids=batch["position_ids"])
            return data_mod.per_sequence(lp, batch["sequence_ids"][:, 1:],
                                         2 * batch["n_pairs"])
        else:
            lp = completion_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                     batch["loss_mask"])
        return lp.sum(-1)  # (2B,)

    @staticmethod
    def _lengths(batch) -> torch.Tensor:
        if "completion_mask" in batch:
            return batch["completion_mask"].sum(-1)
        if "sequence_ids" in batch:
            return data_mod.per_sequence(batch["loss_mask"][:, 1:], batch["sequence_ids"][:, 1:],
                                         2 * batch["n_pairs"])
        return batch["loss_mask"][:, 1:].sum(-1)

    def collate(self, examples, with_ref: bool = True):
        batch = _pair_batch(examples, self.tokenizer.pad_token_id, self.share_prompt,
                            self.packing, self.budget)
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
                ref = self._reference_logps(batch)
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


def _start(cfg, kind: str):
    """Process settings, seeds, the resume directory checked, the tokenizer and the data;
    and the checkpoint to resume from (or None)."""
    resume = loop.start_run(cfg)
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    train_ex, eval_ex = _encode(cfg, tokenizer, kind)
    return tokenizer, train_ex, eval_ex, resume


def _policy(cfg, resume):
    return trained.load_trained(cfg, resume, lambda name: trained.load_policy(cfg, name,
                                                                         trained=True))


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    tokenizer, train_ex, eval_ex, resume = _start(cfg, "sft")
    model = _policy(cfg, resume)
    compile_models(cfg, [model], model.device)
    return SFTTrainer(cfg, trained.shard_trained(cfg, model), tokenizer, train_ex, eval_ex).train()


def run_rm(cfg: RMConfig) -> dict[str, float]:
    tokenizer, train_ex, eval_ex, resume = _start(cfg, "preference")
    loop.seed_everything(cfg.seed)  # a fresh scalar head is drawn from torch's global generator
    dtype = sharding.load_dtype(cfg, pick_device(cfg.device))
    first = _pair_batch(train_ex[:cfg.batch_size], tokenizer.pad_token_id)
    head_batch = ((first["input_ids"], first["attention_mask"])
                  if cfg.head_init == "unit_scores" else None)
    model = fast.prepare_model(trained.load_trained(
        cfg, resume, lambda name: load_reward_model(name, tokenizer, dtype, cfg.device,
                                                    cfg.trust_remote_code, head_batch),
        heads=("score",)), cfg.fast)
    compile_models(cfg, [model], model.device)
    return RewardTrainer(cfg, trained.shard_trained(cfg, model), tokenizer, train_ex,
                         eval_ex).train()


def run_dpo(cfg: DPOConfig) -> dict[str, float]:
    tokenizer, train_ex, eval_ex, resume = _start(cfg, "preference")
    model = _policy(cfg, resume)
    # whole on every rank, even sharded; with LoRA and no other ref_model: the policy's base
    ref = (None if lora.wanted(cfg) and not cfg.ref_model
           else trained.load_policy(cfg, cfg.ref_model or cfg.model))
    trainer = DPOTrainer(cfg, trained.shard_trained(cfg, model), tokenizer, train_ex, eval_ex, ref)
    compile_models(cfg, [model, trainer.ref_model], model.device)  # compile: never sharded
    return trainer.train()
