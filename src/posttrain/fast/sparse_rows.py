"""The input embedding trained by rows: its gradient holds only the rows of the tokens a step
saw, and AdamW keeps its two states only for rows that have ever had a gradient
(``sparse_embedding_grad``, with ``fast``).

Why. At a 151,936-token vocabulary and hidden size 512 the input embedding is 78M weights,
311 MB in float32. Full fine-tuning in plain PyTorch holds, for it alone, a dense gradient
that is zero outside the few thousand rows a batch uses, and two dense AdamW states that stay
zero in every row no token has reached yet: 933 MB, and a pass over all of it each step.

What is exact. A row that has never had a gradient has ``m = v = 0``, so AdamW's update
``lr · m̂ / (√v̂ + ε)`` is exactly 0 there; only the decoupled weight decay moves it, and that
is still applied to every row. A row that has had a gradient keeps its states and is updated
every step afterwards, with a zero gradient when its token is absent, as the dense optimiser
does. Bias corrections count the optimiser's steps, not a row's. So the weights equal dense
AdamW's to float rounding (tested against ``torch.optim.AdamW``; in bfloat16 the row step
rounds each of its operations to bfloat16, where torch's fused kernel rounds once, so the
weights can differ by an ulp). What differs is only where
the states live: ``rows`` (sorted token ids) with ``exp_avg``/``exp_avg_sq`` of shape
``(len(rows), H)``; once half the vocabulary has been touched the states become dense again
(``rows`` dropped), and the update still never forms a dense gradient.

Where it applies: one process, a trainable ``nn.Embedding`` that is not tied to the output
head (a tied weight's head gradient is dense anyway), not sharded. Elsewhere, and with
``fast=false``, everything is dense, and checkpoints load both ways.
"""

from __future__ import annotations

import math

import torch

DENSE_FROM = 0.5
"""The share of the vocabulary touched from which the states are held dense."""

_CHUNK_ROWS = 4096
"""Rows per update chunk: the update's temporaries stay a few MB however large the vocabulary."""


def sparse_embedding_gradients(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """Have the model's input embedding produce sparse (row) gradients, when it is a trainable
    ``nn.Embedding`` (or a subclass, as Gemma's scaled embedding) whose weight the output head
    does not share; returns that weight, else None and nothing changes."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    if not isinstance(emb, torch.nn.Embedding) or not emb.weight.requires_grad:
        return None
    if emb.max_norm is not None or hasattr(emb.weight, "to_local"):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is emb.weight:
        return None
    emb.sparse = True
    return emb.weight


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that also takes sparse COO gradients (from an embedding with
    ``sparse=True``), keeping those parameters' states by rows (see the module's docstring).
    Dense gradients take torch's own step, unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # torch's own step runs between these two hooks (public hooks rather than an
        # overridden step: torch wraps every class's step to call the step hooks, so a
        # subclass calling super().step() would run them twice)
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.register_step_pre_hook(AdamW._hide_rows)
        self.register_step_post_hook(AdamW._step_rows)

    @staticmethod
    def _hide_rows(self: AdamW, *_) -> None:
        """Take the sparse gradients away from torch's step (it leaves out parameters without
        a gradient); a rows state meeting a dense gradient (fast turned off) turns dense."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    self._held.append((p, p.grad))
                    p.grad = None
                elif "rows" in self.state[p]:
                    _to_dense(self.state[p], p.shape)

    @staticmethod
    def _step_rows(self: AdamW, *_) -> None:
        held, self._held = self._held, []
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        for p, grad in held:
            p.grad = grad
            self._row_step(p, group_of[id(p)])

    @torch.no_grad()
    def _row_step(self, p: torch.Tensor, group: dict) -> None:
        if group["amsgrad"] or group["maximize"]:
            raise ValueError("sparse embedding gradients support plain AdamW only")
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grad = p.grad.coalesce()
        idx, val = grad.indices()[0], grad.values()  # (n,) unique rows, (n, H)
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["rows"] = torch.empty(0, dtype=torch.long, device=p.device)
            st["exp_avg"] = p.new_zeros((0, *p.shape[1:]))
            st["exp_avg_sq"] = p.new_zeros((0, *p.shape[1:]))
        st["step"] += 1
        t = float(st["step"])
        if wd:
            p.mul_(1 - lr * wd)  # decoupled decay: every row, touched or not
        rows = st.get("rows")  # None: dense states (turned dense, or from a dense checkpoint)
        if rows is not None:
            rows = _grow(st, idx, p.shape[0])
        pos = idx if rows is None else torch.searchsorted(rows, idx)
        m, v = st["exp_avg"], st["exp_avg_sq"]  # (K, H): the rows of ``rows``, or all
        m.mul_(b1).index_add_(0, pos, val, alpha=1 - b1)
        v.mul_(b2).index_add_(0, pos, val * val, alpha=1 - b2)
        step_size = lr / (1 - b1 ** t)
        bc2_sqrt = math.sqrt(1 - b2 ** t)
        for s in range(0, m.shape[0], _CHUNK_ROWS):
            e = s + _CHUNK_ROWS
            denom = v[s:e].sqrt().div_(bc2_sqrt).add_(eps)
            if rows is None:
                p[s:e].addcdiv_(m[s:e], denom, value=-step_size)
            else:
                p.index_add_(0, rows[s:e], m[s:e] / denom, alpha=-step_size)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every non-step state tensor to the parameter's dtype: keep the row ids
        rows = {pid: st["rows"] for pid, st in state_dict["state"].items() if "rows" in st}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, r in rows.items():
            self.state[params[int(pid)]]["rows"] = r.to(torch.long).to(params[int(pid)].device)


def _grow(st: dict, idx: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """Add the rows ``idx`` to the state's ``rows`` (zero states for new ones); the rows, or
    None once the states have turned dense."""
    rows = st["rows"]
    new = idx[~torch.isin(idx, rows)] if len(rows) else idx
    if len(new) == 0:
        return rows
    merged = torch.cat([rows, new]).sort().values
    if len(merged) >= DENSE_FROM * vocab:
        _to_dense(st, (vocab, *st["exp_avg"].shape[1:]))
        return None
    at = torch.searchsorted(merged, rows)
    for k in ("exp_avg", "exp_avg_sq"):
        grown = st[k].new_zeros((len(merged), *st[k].shape[1:]))
        grown.index_copy_(0, at, st[k])
        st[k] = grown
    st["rows"] = merged
    return merged


def dense_state_dict(sd: dict, params: list[torch.Tensor]) -> dict:
    """``sd`` (an optimiser ``state_dict()``, parameters by position) with every rows state
    written out dense, for a loader that knows only dense states (a sharded model's)."""
    for pid, st in sd["state"].items():
        if "rows" in st:
            st["rows"] = st["rows"].to(torch.long)
            _to_dense(st, params[int(pid)].shape)
    return sd


def _to_dense(st: dict, shape) -> None:
    """A rows state as torch's dense one of the parameter's ``shape``."""
    rows = st.pop("rows")
    for k in ("exp_avg", "exp_avg_sq"):
        full = st[k].new_zeros(shape)
        full.index_copy_(0, rows, st[k])
        st[k] = full
