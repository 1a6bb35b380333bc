"""Mixture-of-experts routing: record which experts each token went to, and replay them.

Implemented once, on the router modules of ``transformers``' mixture-of-experts blocks
(``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``, ...: a module with a
``weight`` ``(experts, hidden)`` and ``top_k`` whose forward returns ``(logits, scores,
indices)`` for the flattened tokens of a call), by forward hooks — no family's block is
copied.

:class:`Routing` keeps the decisions in a layout of its own, ``(routers, rows, positions,
k)``: a forward runs inside ``routing.call(rows, mask, mode)``, where ``rows`` are the
sequences of the call's batch and ``mask`` ``(len(rows), T)`` its real tokens, so a
recording made in one pass (all rows at once) replays in another (micro-batches of them).

- ``record``: each router's chosen experts are stored.
- ``compare``: the router routes as it will, and the tokens whose expert set differs from
  the stored one are counted (what replay would have changed).
- ``replay``: each router routes through the stored experts (a token with none stored
  routes as the router chooses); the gate's weights still come
  from the current router's probabilities over them, normalised as the family normalises
  its top-k (so the router keeps learning, and a replay of the routing it would have chosen
  is exactly the plain forward). The share of real tokens whose expert set differs from
  what the router would have chosen is counted (:attr:`Routing.disagreement`).
- both: per router, the experts' load, the router's entropy and the auxiliary
  load-balancing loss, over the real tokens (:meth:`Routing.metrics`).
"""

from __future__ import annotations

import contextlib

import torch


def routers(model) -> list[torch.nn.Module]:
    """The model's top-k routers, in the order its forward calls them."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")
            and hasattr(m, "weight") and hasattr(m, "top_k")]


def is_moe(model) -> bool:
    return bool(routers(model))


def aux_coef(model, given: float | None) -> float:
    """The auxiliary loss's weight: ``given``, or as the model's config defines its training
    loss (``router_aux_loss_coef`` when ``output_router_logits`` is set, else 0); a weight
    for a model with no router is refused."""
    if given is None:
        c = model.config
        given = (float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0)
                 if is_moe(model) and getattr(c, "output_router_logits", False) else 0.0)
    if given and not is_moe(model):
        raise ValueError(f"router_aux_loss_coef={given} needs a mixture-of-experts model; "
                         f"{type(model).__name__} has no router")
    return float(given)


def family_aux_loss(router, logits: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """The family's own auxiliary load-balancing loss (``load_balancing_loss_func`` of
    ``router``'s modeling module) over one forward's router ``logits`` (every router's, in
    order) and its real tokens ``mask`` ``(B, T)``."""
    import sys

    fn = getattr(sys.modules[type(router).__module__], "load_balancing_loss_func", None)
    if fn is None:
        raise ValueError(f"{type(router).__name__}'s family defines no auxiliary loss")
    return fn(tuple(logits), logits[0].shape[-1], router.top_k, mask.long())


class _Hooks:
    """What holds forward hooks (``self._hooks``): closing (or leaving it as a context
    manager) removes them."""

    _hooks: list

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RouterLosses(_Hooks):
    """The family's auxiliary load-balancing loss of the forwards run inside it that record
    gradients (a reference pass under ``no_grad`` is left out), whatever calls them: hooks
    on the routers keep each forward's router logits, and a hook on the decoder stack its
    attention mask (its last columns, where the forward runs over a cache). :meth:`loss` is
    the real-token-weighted mean over those forwards, differentiable."""

    def __init__(self, model):
        self.routers = routers(model)
        stack = next(m for m in model.modules()
                     if isinstance(getattr(m, "layers", None), torch.nn.ModuleList))
        self._calls: list[tuple[torch.Tensor | None, list[torch.Tensor]]] = []
        self._hooks = [stack.register_forward_pre_hook(self._begin, with_kwargs=True)]
        self._hooks += [r.register_forward_hook(self._keep) for r in self.routers]

    def _begin(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            self._calls.append((None, []))  # (a forward whose logits are not kept)
            return None
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs["inputs_embeds"]
        B, T = x.shape[:2]
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(B, T, dtype=torch.long, device=x.device)
        if mask.dim() != 2:
            raise ValueError("the auxiliary router loss needs a 2-D attention mask (a packed "
                             "or custom mask hides which tokens are real)")
        self._calls.append((mask[:, -T:], []))
        return None

    def _keep(self, module, args, output):
        if self._calls and self._calls[-1][0] is not None:
            self._calls[-1][1].append(output[0])

    def loss(self) -> torch.Tensor | None:
        total, weight = None, 0.0
        for mask, logits in self._calls:
            if mask is None or not logits:
                continue
            n = float(mask.sum())
            term = family_aux_loss(self.routers[0], logits, mask) * n
            total, weight = (term, n) if total is None else (total + term, weight + n)
        return None if total is None else total / max(weight, 1.0)


def _stat_fields(router) -> tuple[tuple[str, int], ...]:
    """The per-router statistics :meth:`Routing.metrics` reads, and their sizes."""
    E = router.weight.shape[0]
    return (("counts", E), ("prob_sum", E), ("entropy_sum", 1), ("tokens", 1))


def replay_scores(router, logits: torch.Tensor, indices: torch.Tensor, dtype) -> torch.Tensor:
    """The gate's weights of the experts ``indices`` ``(tokens, k)``: the router's softmax
    at them, normalised over them as the family does (Mixtral always; Qwen-MoE when
    ``norm_topk_prob``)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype)


class Routing(_Hooks):
    """Recorded routing of ``rows`` sequences of up to ``width`` positions through
    ``model``'s routers (see the module docstring). Close it (or use it as a context
    manager) to remove its hooks."""

    def __init__(self, model, rows: int, width: int):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router")
        k = max(r.top_k for r in self.routers)
        self.indices = torch.full((len(self.routers), rows, width, k), -1, dtype=torch.long,
                                  device=next(model.parameters()).device)
        self._call: tuple | None = None  # (rows, mask, mode)
        self.collect_logits = False
        """Keep each call's router logits (with their graph) for :meth:`aux_loss`."""
        self._logits: list[torch.Tensor] = []
        self._mask: torch.Tensor | None = None
        self.recorded = torch.zeros(rows, dtype=torch.bool, device=self.indices.device)
        self.differ = [0.0] * len(self.routers)  # per router: replayed real tokens that
        self.counted = [0.0] * len(self.routers)  # the router would have sent elsewhere
        self.counting = True
        """Whether replays and comparisons add to :attr:`disagreement` now."""
        self._stats: list[dict[str, torch.Tensor]] = [{} for _ in self.routers]
        self._hooks = [r.register_forward_hook(self._hook(i))
                       for i, r in enumerate(self.routers)]

    @contextlib.contextmanager
    def call(self, rows: torch.Tensor, mask: torch.Tensor, mode: str):
        """A forward of the sequences ``rows`` (real tokens ``mask``) that records or
        replays."""
        if mode not in ("record", "replay", "compare", "observe"):
            raise ValueError(f"routing mode {mode!r}")
        self._call = (rows, mask.bool(), mode)
        self._logits, self._mask = [], None  # (what aux_loss reads: this call's)
        try:
            yield self
        finally:
            self._call = None

    def _hook(self, i: int):
        def hook(module, args, output):
            if self._call is None:
                return None
            rows, mask, mode = self._call
            logits, scores, idx = output
            B, T = mask.shape
            if idx.shape[0] != B * T:
                raise RuntimeError(f"routing: a call of {idx.shape[0]} tokens, not the "
                                   f"{B}×{T} of its rows")
            k = idx.shape[1]
            real = mask.reshape(-1)
            if self.collect_logits:
                self._logits.append(logits)
                self._mask = mask
            if mode == "record":
                self.indices[i, rows, :T, :k] = idx.view(B, T, k)
                self.recorded[rows] = True
            self._observe(i, logits, idx, real)
            if mode not in ("replay", "compare"):
                return None
            want = self.indices[i, rows, :T, :k].reshape(-1, k)
            # padding, and a token never recorded (a sample's last, never fed while
            # sampling): the router's own routing
            held = real & (want >= 0).all(-1)
            want = torch.where(held[:, None], want, idx)
            if self.counting:
                same = (want.sort(-1).values == idx.sort(-1).values).all(-1)
                self.differ[i] += float((~same & held).sum())
                self.counted[i] += float(held.sum())
            if mode == "compare":  # counted only: the router's own routing goes on
                return None
            return logits, replay_scores(module, logits, want, scores.dtype), want
        return hook

    def _observe(self, i: int, logits, idx, real) -> None:
        """Accumulate router ``i``'s load, entropy and auxiliary-loss terms over the call's
        real tokens."""
        with torch.no_grad():
            probs = torch.softmax(logits.detach().float()[real], dim=-1)  # (n, E)
            E = probs.shape[-1]
            counts = torch.zeros(E, device=probs.device).index_add_(
                0, idx[real].reshape(-1), torch.ones(idx[real].numel(), device=probs.device))
            s = self._stats[i]
            for key, value in (("counts", counts), ("prob_sum", probs.sum(0)),
                               ("entropy_sum", -(probs * probs.clamp_min(1e-30).log())
                                .sum(-1).sum()), ("tokens", torch.tensor(float(len(probs))))):
                s[key] = s.get(key, 0) + value

    def aux_loss(self) -> torch.Tensor | None:
        """The auxiliary load-balancing loss of the last forward, as the model's family
        defines it (its ``load_balancing_loss_func`` over every router's logits, the real
        tokens only), differentiable; None without collected logits. Clears them."""
        logits, mask = self._logits, self._mask
        self._logits, self._mask = [], None
        return family_aux_loss(self.routers[0], logits, mask) if logits else None

    def load(self, recorded: torch.Tensor) -> None:
        """Take a rollout's recording (``(rows, routers, positions, k)``, -1 where none, as
        :class:`RolloutRecorder` makes it) as this one's."""
        rows, L, W, k = recorded.shape
        if rows != self.indices.shape[1] or self.indices.shape[0] != L:
            raise ValueError(f"routing: a recording of {rows} rows × {L} routers for "
                             f"{self.indices.shape[1]} × {self.indices.shape[0]}")
        W = min(W, self.indices.shape[2])
        self.indices[:, :, :W, :k] = recorded[:, :, :W].permute(1, 0, 2, 3).to(
            self.indices.device)
        self.recorded[:] = True

    def has(self, rows: torch.Tensor) -> bool:
        """Whether every one of ``rows`` was recorded."""
        return bool(self.recorded[rows].all())

    @property
    def disagreement(self) -> float:
        """The share of replayed real tokens (over every router) whose expert set differs
        from the one the router chose; NaN before any replay."""
        n = sum(self.counted)
        return sum(self.differ) / n if n else float("nan")

    def accumulators(self) -> list[float]:
        """What :meth:`metrics` reads, flat (per router: differ, counted, the experts'
        counts and probability sums, the entropy sum, the tokens), to be summed over ranks
        and given back with :meth:`set_accumulators`."""
        out: list[float] = []
        for i, r in enumerate(self.routers):
            out += [self.differ[i], self.counted[i]]
            for key, size in _stat_fields(r):
                v = self._stats[i].get(key)
                out += ([0.0] * size if v is None else
                        torch.as_tensor(v, dtype=torch.float64).reshape(-1).tolist())
        return out

    @staticmethod
    def no_accumulators(model) -> list[float]:
        """:meth:`accumulators` of a rank that ran no routed forward: zeros."""
        return [0.0] * sum(2 + sum(n for _, n in _stat_fields(r)) for r in routers(model))

    def set_accumulators(self, flat: list[float]) -> None:
        at = 0
        for i, r in enumerate(self.routers):
            self.differ[i], self.counted[i] = flat[at], flat[at + 1]
            at += 2
            st = {}
            for key, size in _stat_fields(r):
                v = torch.tensor(flat[at:at + size], dtype=torch.float64)
                st[key] = v if size > 1 else v[0]
                at += size
            self._stats[i] = st if float(st["tokens"]) > 0 else {}

    def metrics(self, prefix: str = "router/") -> dict[str, float]:
        """Per router ``i``: ``load_max_over_mean_i`` (the busiest expert's share of the
        assignments against the mean share, 1 when balanced), ``entropy_i`` (nats, mean
        over tokens), ``aux_loss_i`` (the Switch load-balancing loss E·Σ_e f_e·P_e: f the
        share of assignments, P the mean probability); their means over routers; and
        ``disagreement`` (and ``disagreement_i``) when replaying or comparing. Accumulated
        since the last call, then reset."""
        out: dict[str, float] = {}
        means: dict[str, list[float]] = {"load_max_over_mean": [], "entropy": [],
                                         "aux_loss": []}
        for i, s in enumerate(self._stats):
            if not s:
                continue
            n = float(s["tokens"])
            if n == 0:
                continue
            f = s["counts"] / s["counts"].sum()
            P = s["prob_sum"] / n
            E = len(f)
            values = {"load_max_over_mean": float(f.max() * E),
                      "entropy": float(s["entropy_sum"]) / n,
                      "aux_loss": float(E * (f * P).sum())}
            for key, v in values.items():
                out[f"{prefix}{key}_{i}"] = v
                means[key].append(v)
        for key, vs in means.items():
            if vs:
                out[f"{prefix}{key}"] = sum(vs) / len(vs)
        if sum(self.counted):
            out[f"{prefix}disagreement"] = self.disagreement
            for i, (d, n) in enumerate(zip(self.differ, self.counted, strict=True)):
                if n:
                    out[f"{prefix}disagreement_{i}"] = d / n
        self._stats = [{} for _ in self.routers]
        self.differ = [0.0] * len(self.routers)
        self.counted = [0.0] * len(self.routers)
        return out


class RolloutRecorder(_Hooks):
    """The experts each sampled sequence's tokens went to while an in-process engine decoded
    it (R3): hooks on the sampler's routers, told before each forward which rows and
    sequence positions its tokens are (:meth:`prefill`, :meth:`step`). :meth:`result` is
    ``(N, routers, positions, k)`` in sequence positions (the prompt from 0), -1 where a
    token was never fed (a sample's last token)."""

    def __init__(self, model, prompt_lens: list[int], n: int, width: int):
        self.routers = routers(model)
        k = max(r.top_k for r in self.routers)
        device = next(model.parameters()).device
        self.lens = torch.tensor(prompt_lens, device=device).repeat_interleave(n)
        self.n = n
        self.out = torch.full((len(self.lens), len(self.routers), width, k), -1,
                              dtype=torch.long, device=device)
        self._where: tuple | None = None
        self._hooks = [r.register_forward_hook(self._hook(i))
                       for i, r in enumerate(self.routers)]

    def prefill(self, Lp: int, held: list[int] | None = None) -> None:
        """The next forward is the prefill of the prompts, left-padded to ``Lp``; ``held``:
        per prompt, the tokens of it already in the cache (a reused prefix), which the
        prefill does not run: it runs the rest, positions ``held[p]`` on."""
        self._where = ("prefill", Lp, held or [0] * (len(self.lens) // self.n))

    def step(self, rows: torch.Tensor, t: int) -> None:
        """The next forward feeds completion token ``t`` of the samples ``rows``."""
        self._where = ("step", rows, t)

    def _hook(self, i: int):
        def hook(module, args, output):
            if self._where is None:
                return None
            idx = output[2]
            k = idx.shape[1]
            if self._where[0] == "prefill":
                _, Lp, held = self._where
                P = len(self.lens) // self.n
                per = idx.view(P, Lp, k)
                for p in range(P):
                    L, h = int(self.lens[p * self.n]), held[p]
                    self.out[p * self.n:(p + 1) * self.n, i, h:L, :k] = per[p, Lp - (L - h):]
            else:
                _, rows, t = self._where
                self.out[rows, i, self.lens[rows] + t, :k] = idx
            return None
        return hook

    def result(self) -> torch.Tensor:
        self.close()
        return self.out.cpu()
