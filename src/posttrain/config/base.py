"""What every run shares: the model, the data, the output directory, the optimiser's
schedule, the run loop's cadences, resume, device and precision, and the speed switch."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

from posttrain.config.errors import ConfigError, check


def check_device(device: str) -> None:
    """A :class:`ConfigError` unless ``device`` names a device this machine has."""
    import torch

    try:
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                           else "cpu" if device == "auto" else device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device {device!r}: expected cpu, cuda, cuda:N or auto"
                          ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: CUDA is not available here "
                              "(no GPU, or a CPU build of torch); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} "
                              "CUDA device(s)")
    elif dev.type != "cpu" and not (dev.type == "mps" and torch.backends.mps.is_available()):
        raise ConfigError(f"device {device!r} is not available here")


@dataclass
class RunConfig:
    """Settings every training command shares."""

    COMMAND: ClassVar[str] = "train"

    model: str = "builtin"
    """Policy to start from: a local Hugging Face directory, a hub id, or 'builtin'."""
    data: str | None = None
    """Training data: .jsonl, .parquet or a saved `datasets` directory; none = the built-in task."""
    eval_data: str | None = None
    """Held-out data in the same format; none = the built-in task's held-out split (or none)."""
    output_dir: str | None = None
    """Where metrics, config.yaml, checkpoints and final/ go; default runs/<command>."""
    seed: int = 0
    """Seed for Python, torch, data order and sampling."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    lr_schedule: str = "cosine"
    """constant, linear or cosine decay after warm-up."""
    warmup_ratio: float = 0.05
    """Share of the steps spent warming the learning rate up from 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_steps: int = 0
    """Steps to run (optimiser steps offline, RL steps online); 0 = derived from epochs
    (offline commands)."""
    max_tokens: int = 0
    """A token budget: end the run (final evaluation, final/) after the step that takes the
    completion tokens past this many (RL: every token sampled, dynamic sampling's dropped
    rounds included; offline: the completions trained on); 0 = no budget. metrics.jsonl
    logs the running count as samples/tokens_total. The schedule is still laid over
    max_steps, so with a budget use lr_schedule=constant (or set max_steps to match)."""
    max_seconds: float = 0.0
    """A time budget: end the run the same way after the step that takes the training time
    (the steps' own seconds, evaluations left out) past this; 0 = no budget. Logged as
    time/train_s."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping threshold; 0 = no clipping."""
    log_every: int = 10
    """Every this many steps: one metrics.jsonl row (the means over those steps) and a
    progress line."""
    eval_every: int = 0
    """Evaluate every this many steps; 0 = at the end only (RL commands also evaluate
    before the first step)."""
    save_every: int = 0
    """Write checkpoint-<step>/ every this many steps; 0 = final model only."""
    resume_from: str | None = None
    """A checkpoint-<step>/ directory of an earlier run of the same config: continue from
    its model, optimiser, RNG and data position up to max_steps: the run that was never
    interrupted, bit for bit with MKL_CBWR=AUTO,STRICT set (MKL otherwise rounds with memory
    alignment), else to float rounding."""
    eval_batch_size: int = 64
    """Examples per evaluation batch."""
    dtype: str = "float32"
    """float32, bfloat16 or float16 weights."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto."""
    fast: bool = True
    """The speed machinery of posttrain.fast (the lean Llama-family decoder and its sampler
    cache, eager attention for short CPU inputs, keep_freed_memory, the embedding trained
    by rows); false = the plain model-agnostic path everywhere (compile stays its own
    opt-in). Results agree to float rounding."""
    keep_freed_memory: bool = True
    """Linux/glibc: keep memory the process frees for reuse instead of returning it to the
    kernel, so each step's activations do not page-fault afresh (results unchanged;
    resident memory stays at its peak; docs/benchmarks.md has what it saves).
    Process-wide; false (or fast=false) leaves malloc's defaults alone."""
    sparse_embedding_grad: bool = True
    """(With fast) the input embedding's gradient holds only the rows of the step's tokens,
    and AdamW keeps its states only for rows that have had a gradient: the same weights to
    float rounding, without a dense vocabulary-sized gradient and two dense states (933 MB
    at a 151,936-token vocabulary, hidden 512). One process, an embedding not tied to the
    head; otherwise dense."""
    compile: bool = False
    """torch.compile the RMSNorm and MLP blocks of the trained model, its reference and
    critic (dynamic shapes; fuses their elementwise work, forward and backward). They compile
    once, on first use (seconds); it pays where kernel launches dominate (a GPU), not on a
    few CPU cores (docs/benchmarks.md); needs a C++ compiler (CPU) or triton (CUDA)."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-experts models: the weight of the family's auxiliary load-balancing loss
    in the trained model's loss (RL: the policy's); none = as the model's config defines it
    (router_aux_loss_coef when output_router_logits is set, else 0), 0 = off."""
    lora_rank: int = 0
    """LoRA through peft: train rank-R adapters on the decoder blocks' linear layers instead
    of every weight; 0 = full fine-tuning. The reference is the policy with its adapter off;
    checkpoints and final/ hold the adapter (posttrain merge writes a plain model)."""
    lora_alpha: float = 0.0
    """The adapters' scale is lora_alpha / lora_rank; 0 = 2 × lora_rank (a scale of 2)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps the trainer's log-probs equal to the
    sampler's)."""
    lora_targets: str = "all-linear"
    """Comma-separated layer names to adapt (q_proj,v_proj, ...); all-linear = every linear
    layer of the decoder blocks."""
    load_in_4bit: bool = False
    """QLoRA: the frozen base quantised to 4 bits (NF4) by bitsandbytes; CUDA only, with
    lora_rank > 0 (pip install 'posttrain[qlora]')."""
    parallel: str = "ddp"
    """Under torchrun: ddp (every rank holds the whole model; gradients summed) or fsdp
    (FSDP2: parameters, gradients and optimiser states sharded over the ranks, each decoder
    layer gathered while it runs; docs/scaling.md). Batch sizes are global either way."""
    cpu_offload: bool = False
    """With parallel=fsdp: keep the shards, gradients and optimiser states in host memory."""
    context_parallel: int = 1
    """Under torchrun: split each sequence's tokens over this many consecutive ranks for the
    training forward and backward (attention exchanged over heads, Ulysses-style), so a
    sequence k times longer fits; the world is then data × context (docs/scaling.md). It must
    divide the ranks and the model's attention heads."""
    overwrite: bool = False
    """Replace a finished run in output_dir (its final/, checkpoints, metrics and config; the
    removed paths are printed); without it such a directory is an error."""
    on_nonfinite: str = "raise"
    """A NaN or inf loss or gradient norm: raise (stop, naming the step) or skip (leave that
    optimiser step out, and count it in optim/nonfinite_skipped)."""
    trust_remote_code: bool = False
    """Run model code shipped with a checkpoint (off unless you trust its source)."""
    tensorboard: bool = True
    """Also write TensorBoard events (when tensorboard is installed)."""
    report_to: str = ""
    """Experiment trackers to log to, comma-separated: tensorboard, wandb, mlflow, trackio
    (each must be installed: ``pip install 'posttrain[trackers]'``). They get the rows of
    metrics.jsonl, the config and the sample tables; a resumed run continues the same
    tracker run (docs/trackers.md)."""
    builtin_train_size: int = 4000
    """Examples generated for the built-in task's training split."""
    builtin_eval_size: int = 500
    """Examples generated for the built-in task's held-out split."""

    def __post_init__(self) -> None:
        self.given: set[str] = set()  # keys set by a file or the command line (not a field)

    @property
    def run_name(self) -> str:
        """The name of the default output directory, runs/<run_name>."""
        return self.COMMAND

    def validate(self) -> None:
        """Check every value and decide the derived ones; raises :class:`ConfigError`."""
        for f in fields(self):  # every float key: inf and NaN mean nothing anywhere
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")
        check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        check(self.weight_decay >= 0, f"weight_decay must be ≥ 0, got {self.weight_decay}")
        check(self.on_nonfinite in ("raise", "skip"), "on_nonfinite must be raise or skip")
        check_device(self.device)
        check(self.lr_schedule in ("constant", "linear", "cosine"),
              "lr_schedule must be constant, linear or cosine")
        check(0 <= self.warmup_ratio < 1, "warmup_ratio must be in [0, 1)")
        check(self.eval_batch_size >= 1, "eval_batch_size must be ≥ 1")
        check(self.max_steps >= 0, f"max_steps must be ≥ 0, got {self.max_steps}")
        check(self.max_tokens >= 0 and self.max_seconds >= 0,
              "max_tokens and max_seconds must be ≥ 0 (0: no budget)")
        check(self.log_every >= 1, f"log_every must be ≥ 1, got {self.log_every}")
        check(self.eval_every >= 0 and self.save_every >= 0,
              "eval_every and save_every must be ≥ 0")
        check(self.dtype in ("float32", "bfloat16", "float16"),
              "dtype must be float32, bfloat16 or float16")
        check(self.max_grad_norm >= 0, "max_grad_norm must be ≥ 0")
        check(self.lora_rank >= 0 and self.lora_alpha >= 0 and 0 <= self.lora_dropout < 1,
              "lora_rank and lora_alpha must be ≥ 0 and lora_dropout in [0, 1)")
        check(not self.load_in_4bit or self.lora_rank > 0,
              "load_in_4bit is QLoRA: it needs lora_rank > 0 (a 4-bit base is not trained)")
        check(not (self.load_in_4bit and self.parallel == "fsdp"),
              "load_in_4bit and parallel=fsdp do not run together (FSDP does not shard "
              "bitsandbytes' 4-bit weights here); use parallel=ddp")
        check(self.parallel in ("ddp", "fsdp"), f"parallel must be ddp or fsdp, got "
              f"{self.parallel!r}")
        check(self.context_parallel >= 1, "context_parallel must be ≥ 1")
        check(self.context_parallel == 1 or not getattr(self, "share_prompt", None),
              "context_parallel splits whole sequences; the shared-prompt layout is not "
              "split: leave share_prompt off")
        check(not self.cpu_offload or self.parallel == "fsdp",
              "cpu_offload needs parallel=fsdp (it offloads FSDP's shards)")
        check(not (self.cpu_offload and self.device == "cpu"),
              "cpu_offload moves FSDP's shards from a GPU to host memory; with device=cpu "
              "they are there already: leave it off")
        check(not (self.compile and self.parallel == "fsdp"),
              "compile and parallel=fsdp do not run together yet; leave compile off")
        check(self.eval_data is None or self.data is not None,
              "eval_data needs data too (the built-in task has its own held-out split)")
        from posttrain.trainers.loop.trackers import check as check_trackers

        problem = check_trackers(self.report_to)
        check(problem is None, problem or "")
        if self.output_dir is None:
            self.output_dir = f"runs/{self.run_name}"

    def refuse(self, keys: tuple[str, ...], why: str) -> None:
        """An unknown-key error for any of ``keys`` that the file or command line set to
        something other than its default: this command (or algorithm) does not read them. (A
        run's own config.yaml lists every key at its value, defaults included, and loads.)"""
        defaults = type(self)()
        for key in keys:
            if key in self.given and getattr(self, key) != getattr(defaults, key):
                raise ConfigError(f"unknown key {key!r} for {why}")
