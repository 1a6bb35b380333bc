"""The optimiser every trainer steps: AdamW over a model's trainable parameters, the
learning rate the run loop schedules, gradient clipping, the non-finite check, and the
data-parallel sum of the gradients (one collective over one flat buffer; FSDP reduces its
own in the backward)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from posttrain import dist, sharding
from posttrain.fast import sparse_rows
from posttrain.trainers.loop import checkpoint as ckpt
from posttrain.trainers.loop.guards import NonFiniteError


def adamw(params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The optimiser of every trainer: torch's AdamW, which here also steps an embedding's
    sparse row gradients (:mod:`posttrain.fast.sparse_rows`; dense gradients take torch's
    own step). The fused kernel (one launch for all parameters) also exists on CPU; it
    matters for small models, whose step is dominated by per-tensor overhead."""
    return sparse_rows.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)


class Optim:
    """AdamW over a model's trainable parameters, with its peak learning rate (the loop
    sets the scheduled rate before each step) and the run's gradient clipping."""

    def __init__(self, name: str, model: torch.nn.Module, lr: float, weight_decay: float,
                 max_grad_norm: float, on_nonfinite: str = "raise",
                 sparse_embedding: bool = False):
        self.name, self.peak_lr, self.max_grad_norm = name, lr, max_grad_norm
        self.on_nonfinite = on_nonfinite
        self.skipped = 0
        """Optimiser steps left out because the gradient norm was not finite."""
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = adamw(self.params, lr, weight_decay)
        self.sharded = sharding.is_sharded(model)
        # one process: the input embedding's gradient by rows (several ranks sum dense ones)
        self.rows = (sparse_rows.sparse_embedding_gradients(model)
                     if sparse_embedding and not self.sharded and dist.world_size() == 1
                     else None)
        """FSDP: the gradients arrive reduce-scattered (summed) in the backward."""
        # several ranks: the gradients live in one buffer, summed in one collective
        self.flat = None if self.sharded else dist.flat_gradients(self.params)
        self._views = [p.grad.data_ptr() for p in self.params] if self.flat is not None else []

    def set_lr(self, scale: float) -> float:
        for group in self.opt.param_groups:
            group["lr"] = self.peak_lr * scale
        return self.peak_lr * scale

    def state_for_save(self) -> dict | None:
        """``opt.state_dict()``, gathered whole for a sharded model (rank 0; None on the
        others); collective, so every rank calls it."""
        if self.sharded:
            return sharding.full_optimizer_state(self.model, self.opt, self.params)
        return self.opt.state_dict()

    def load(self, path: Path) -> None:
        sd = ckpt.read_optimizer(path)
        if self.sharded:  # a one-process checkpoint may hold the embedding's rows states
            sd = sparse_rows.dense_state_dict(sd, self.params)
            sharding.load_optimizer_state(self.model, self.opt, self.params, sd)
        else:
            self.opt.load_state_dict(sd)

    def step(self) -> float:
        # every rank now holds the whole step's gradient (or, sharded, its shard of it)
        if self.sharded:
            pass
        elif self.flat is not None and self._views == [
                -1 if p.grad is None else p.grad.data_ptr() for p in self.params]:
            dist.sum_flat(self.flat)  # autograd accumulated into the views, as it does
        else:
            dist.sum_gradients(self.params)
        return self._apply()

    def _apply(self) -> float:
        """Clip (when max_grad_norm > 0), step, zero the gradients; the gradient norm before
        clipping. A norm that is not finite raises :class:`NonFiniteError`, or with
        ``on_nonfinite="skip"`` leaves the step out (counted in ``skipped``)."""
        if self.rows is not None and self.rows.grad is not None:
            norm = self._clip_with_rows()
        elif self.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        else:  # the norm only (torch < 2.6 has no get_total_norm: clip at infinity)
            total = getattr(torch.nn.utils, "get_total_norm", None)
            norm = (total([p.grad for p in self.params if p.grad is not None]) if total
                    else torch.nn.utils.clip_grad_norm_(self.params, float("inf")))
        norm = float(sharding.full_tensor(norm))
        if not math.isfinite(norm):
            self.opt.zero_grad(set_to_none=self.flat is None)
            if self.on_nonfinite == "raise":
                raise NonFiniteError(f"the gradient norm of the {self.name} is {norm}; stopped "
                                     "before the update (lower --lr, check the data and "
                                     "rewards, or pass --on_nonfinite skip)")
            self.skipped += 1
            return norm
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.flat is None)
        return norm

    def _clip_with_rows(self) -> torch.Tensor:
        """``clip_grad_norm_`` when the embedding's gradient is sparse: the norm counts each
        row once (duplicates summed first), and clipping scales the stored rows."""
        self.rows.grad = self.rows.grad.coalesce()
        grads = [p.grad.values() if p.grad.is_sparse else p.grad
                 for p in self.params if p.grad is not None]
        wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.to(wide)) for g in grads]))
        if self.max_grad_norm > 0 and math.isfinite(norm):
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return norm
