"""Replayed projections: the first update after sampling takes the linear-layer outputs the
lean sampler computed instead of running those matmuls again (2·N FLOPs per completion token
saved), with the gradients of the real modules.

The activations are only valid for the weights that produced them: they travel inside the
version-checked :class:`posttrain.fast.cache.SamplerCache`, which refuses them once the
policy has moved.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from posttrain.models import decoder_layers


class _ReplayedLinear(torch.autograd.Function):
    """``y = x @ W.T + b`` where ``y`` is already known: the forward returns it, the backward
    is a linear layer's (input, weight and bias gradients from the saved ``x`` and ``W``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, y):
        ctx.save_for_backward(x, weight)
        ctx.with_bias = bias is not None
        return y.view_as(y)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = gy @ weight
        flat = gy.reshape(-1, gy.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = flat.T @ x.reshape(-1, x.shape[-1])
        if ctx.with_bias and ctx.needs_input_grad[2]:
            gb = flat.sum(0)
        return gx, gw, gb, None

def _adapter_grads(gy: torch.Tensor, x: torch.Tensor, a, b, s: float, need_a: bool,
                   need_b: bool):
    """The gradients of a LoRA adapter ``s·(x @ A.T) @ B.T`` whose output gradient is
    ``gy``: ``(gy @ B) @ A · s`` for the input (in ``gy``'s dtype), and A's and B's (None
    where not needed), computed in the adapters' dtype as peft's forward computes (it keeps
    them float32 over a half-precision base)."""
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    dtype = gy.dtype
    gy, x = gy.to(a.dtype), x.to(a.dtype)
    gyb = gy @ b  # (..., r): the gradient at the adapter's bottleneck, over s
    ga = (flat(gyb).T @ flat(x)) * s if need_a else None
    gb = (flat(gy).T @ (flat(x) @ a.T)) * s if need_b else None
    return ((gyb @ a) * s).to(dtype), ga, gb


class _ReplayedLoRALinear(torch.autograd.Function):
    """A LoRA linear layer ``y = x @ W.T + b + s·(x @ A.T) @ B.T`` (W, b frozen) whose ``y`` is
    already known (the sampler computed it with the merged ``W + s·B·A``): the forward
    returns it; the backward gives the input's and the adapters' gradients from the saved
    ``x`` (``x @ A.T`` is recomputed: rank-wide, cheap), and no gradient for ``W``."""

    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, scaling, y):
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        ctx.scaling = scaling
        return y.view_as(y)

    @staticmethod
    def backward(ctx, gy):
        x, weight, a, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx_lora, ga, gb = _adapter_grads(gy, x, a, b, ctx.scaling, need[2], need[3])
        gx = gy @ weight + gx_lora if need[0] else None
        return gx, None, ga, gb, None, None


def lora_parts(module):
    """``(W, A, B, scaling)`` of a peft LoRA linear layer with one active, plain adapter (no
    dropout, DoRA, bias on B or other variant), else None (the base's bias, if any, is
    frozen: no gradient to give)."""
    base = getattr(module, "base_layer", None)
    lora_a = getattr(module, "lora_A", None)
    if base is None or lora_a is None:
        return None
    active = [a for a in module.active_adapters if a in lora_a]
    if len(active) != 1 or getattr(module, "fan_in_fan_out", False) or \
            getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return None
    a = active[0]
    if type(base) is not torch.nn.Linear or module.use_dora.get(a, False) or \
            getattr(module, "lora_bias", {}).get(a, False) or \
            a in getattr(module, "lora_variant", {}) or \
            not isinstance(module.lora_dropout[a], torch.nn.Identity):
        return None
    return base.weight, module.lora_A[a].weight, module.lora_B[a].weight, module.scaling[a]


def is_replayable_projection(module) -> bool:
    """A projection :func:`replay_forward` can stand in for: a plain ``nn.Linear``, or a
    peft LoRA layer over one (one adapter, no dropout, no DoRA)."""
    return type(module) is torch.nn.Linear or lora_parts(module) is not None


class _ReplayedSwiGLU(torch.autograd.Function):
    """A SwiGLU MLP, ``down(silu(gate(x)) * up(x))`` without biases, whose gate and up
    projections ``g``, ``u`` and output ``d`` are already known. The forward returns ``d``;
    the backward is the MLP's, with ``silu(g) * u`` recomputed from the saved ``g`` and
    ``u`` (two elementwise ops) instead of kept: autograd through the module keeps
    ``silu(g)`` and the product as well, two more ``intermediate``-wide tensors per token."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, g, u, d):
        ctx.save_for_backward(x, w_gate, w_up, w_down, g, u)
        return d.view_as(d)

    @staticmethod
    def backward(ctx, gd):
        import torch.nn.functional as F

        x, w_gate, w_up, w_down, g, u = ctx.saved_tensors
        act = F.silu(g)
        gp = gd @ w_down  # gradient of the product silu(g) * u
        # the gate's and up's output gradients side by side, so the input gradient and the
        # two weight gradients are one matmul each over both (no add, larger matmuls)
        inter = g.shape[-1]
        ggu = gp.new_empty(*gp.shape[:-1], 2 * inter)
        torch.ops.aten.silu_backward(gp * u, g, grad_input=ggu[..., :inter])
        torch.mul(gp, act, out=ggu[..., inter:])
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        need = ctx.needs_input_grad
        gx = ggu @ torch.cat([w_gate, w_up]) if need[0] else None
        gw_gate = gw_up = None
        if need[1] or need[2]:
            gw = flat(ggu).T @ flat(x)
            gw_gate, gw_up = gw[:inter] if need[1] else None, gw[inter:] if need[2] else None
        gw_down = flat(gd).T @ flat(act * u) if need[3] else None
        return gx, gw_gate, gw_up, gw_down, None, None, None


class _ReplayedLoRASwiGLU(torch.autograd.Function):
    """:class:`_ReplayedSwiGLU` for an MLP whose three projections all carry LoRA adapters
    (frozen W; ``g``, ``u``, ``d`` computed by the sampler with merged weights): the
    backward gives the input's and the six adapter matrices' gradients, keeping only ``x``,
    ``g`` and ``u`` (``silu(g) * u`` recomputed, as there)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, a_g, b_g, a_u, b_u, a_d, b_d, scales, g, u, d):
        ctx.save_for_backward(x, w_gate, w_up, w_down, a_g, b_g, a_u, b_u, a_d, b_d, g, u)
        ctx.scales = scales
        return d.view_as(d)

    @staticmethod
    def backward(ctx, gd):
        import torch.nn.functional as F

        x, w_gate, w_up, w_down, a_g, b_g, a_u, b_u, a_d, b_d, g, u = ctx.saved_tensors
        s_g, s_u, s_d = ctx.scales
        need = ctx.needs_input_grad
        act = F.silu(g)
        product = act * u
        gp_lora, ga_d, gb_d = _adapter_grads(gd, product, a_d, b_d, s_d, need[8], need[9])
        gp = gd @ w_down + gp_lora
        inter = g.shape[-1]
        ggu = gp.new_empty(*gp.shape[:-1], 2 * inter)
        torch.ops.aten.silu_backward(gp * u, g, grad_input=ggu[..., :inter])
        torch.mul(gp, act, out=ggu[..., inter:])
        gg, gu = ggu[..., :inter], ggu[..., inter:]
        gx_g, ga_g, gb_g = _adapter_grads(gg, x, a_g, b_g, s_g, need[4], need[5])
        gx_u, ga_u, gb_u = _adapter_grads(gu, x, a_u, b_u, s_u, need[6], need[7])
        gx = ggu @ torch.cat([w_gate, w_up]) + gx_g + gx_u if need[0] else None
        return (gx, None, None, None, ga_g, gb_g, ga_u, gb_u, ga_d, gb_d, None, None, None,
                None)

@contextlib.contextmanager
def replay_forward(outputs: dict[torch.nn.Module, torch.Tensor | tuple] | None):
    """Within the block, each module in ``outputs`` returns its given output instead of
    computing it, with the gradients of the real module: a forward whose matmuls were
    already computed elsewhere (the sampler's, see :class:`DecodeActivations`) costs only
    its other ops. A ``nn.Linear`` maps to its output; a SwiGLU MLP (``gate_proj``,
    ``up_proj``, ``down_proj`` without biases, SiLU) to ``(gate output, up output, MLP
    output)``, and keeps less for its backward than autograd would (``_ReplayedSwiGLU``).

    The caller vouches that the outputs are what the modules would compute on this call's
    inputs (same weights, same tokens); a call whose input shape does not match its
    output's, or a module called twice, raises. A peft LoRA layer maps to its output like
    a linear layer, with its adapters' gradients (``_ReplayedLoRALinear``; the sampler that
    computed the output ran on the merged weights), and an MLP whose three projections are
    all adapted to its three outputs (``_ReplayedLoRASwiGLU``). Each output is taken out of
    ``outputs`` when its module runs, so one that the backward does not need is freed as soon as the
    forward is done with it (if the caller holds no other reference). ``None`` changes
    nothing."""
    if not outputs:
        yield
        return

    def replayed(module):
        def forward(x):
            y = outputs.pop(module, None)
            if y is None:
                raise RuntimeError("a replayed module ran twice in one forward")
            out = y[-1] if isinstance(y, tuple) else y
            if x.shape[:-1] != out.shape[:-1]:
                raise RuntimeError(f"replayed {type(module).__name__} got input "
                                   f"{tuple(x.shape)} for saved output {tuple(out.shape)}")
            if isinstance(y, tuple):
                parts = [lora_parts(p) for p in (module.gate_proj, module.up_proj,
                                                  module.down_proj)]
                if all(parts):
                    (wg, ag, bg, sg), (wu, au, bu, su), (wd, ad, bd, sd) = parts
                    return _ReplayedLoRASwiGLU.apply(x, wg, wu, wd, ag, bg, au, bu, ad, bd,
                                                     (sg, su, sd), *y)
                return _ReplayedSwiGLU.apply(x, module.gate_proj.weight, module.up_proj.weight,
                                             module.down_proj.weight, *y)
            lora = lora_parts(module)
            if lora is not None:
                return _ReplayedLoRALinear.apply(x, *lora, y)
            return _ReplayedLinear.apply(x, module.weight, module.bias, y)
        return forward

    modules = list(outputs)
    for module in modules:
        module.forward = replayed(module)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


@dataclass
class DecodeActivations:
    """What the sampler's forward computed, kept so the first update after sampling need not
    compute it again: for each decoder layer, the outputs of its projections at each
    completion position, ``(N, Tc, features)`` per layer and projection — ``qk`` (q and k
    side by side, before rotation), ``v``, ``o``, ``gu`` (gate and up side by side) and
    ``down``. Each is its own tensor, so those the backward does not need (q and k, o and
    down) are freed as the forward that replays them goes through the layers.

    Column ``t`` holds what the model computed on completion token ``t`` (the position
    that predicts token ``t + 1``). A row's last token, and its padding, were never fed to
    the model: those columns are zero, and nothing a loss reads depends on them.
    """

    layers: list[dict[str, torch.Tensor]]

    def rows(self, rows: torch.Tensor) -> DecodeActivations:
        """The samples ``rows``; a view when they are a contiguous ascending range (the
        whole batch, say), else a copy."""
        r = rows.tolist()
        if r and r == list(range(r[0], r[0] + len(r))):
            rows = slice(r[0], r[0] + len(r))
        return DecodeActivations([{k: v[rows] for k, v in d.items()} for d in self.layers])

    def replay(self, model, columns: int) -> contextlib.AbstractContextManager:
        """A context in which ``model``'s projections return these outputs
        (:func:`replay_forward`), for the completion call of a shared-prompt pass over the
        first ``columns`` positions (``model`` must be the policy that sampled them: the
        cache that holds them checks)."""
        return replay_forward(self.replay_map(model, columns))

    @classmethod
    def concat(cls, parts: list[DecodeActivations], T: int) -> DecodeActivations | None:
        """Several rollouts' activations as one, padded with zeros to ``T`` columns."""
        if len(parts) == 1 and all(v.shape[1] == T for d in parts[0].layers for v in d.values()):
            return parts[0]

        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[1]))

        layers = [{k: torch.cat([pad(p.layers[i][k]) for p in parts]) for k in parts[0].layers[i]}
                  for i in range(len(parts[0].layers))]
        return cls(layers)

    def replay_map(self, model, columns: int) -> dict[torch.nn.Module, torch.Tensor | tuple]:
        """What :func:`replay_forward` takes for ``model``: each attention
        projection mapped to its saved output, each MLP to its gate, up and output, over the
        first ``columns`` completion positions."""
        out: dict[torch.nn.Module, torch.Tensor | tuple] = {}
        for layer, saved in zip(decoder_layers(model), self.layers, strict=True):
            a, m = layer.self_attn, layer.mlp
            cut = {k: v[:, :columns] for k, v in saved.items()}
            inter = cut["gu"].shape[-1] // 2
            q = a.q_proj.out_features
            out.update({a.q_proj: cut["qk"][..., :q], a.k_proj: cut["qk"][..., q:],
                        a.v_proj: cut["v"], a.o_proj: cut["o"]})
            gate, up = cut["gu"][..., :inter], cut["gu"][..., inter:]
            mlp = (m.gate_proj, m.up_proj, m.down_proj)
            if all(type(p) is torch.nn.Linear for p in mlp) or all(
                    lora_parts(p) is not None for p in mlp):
                out[m] = (gate, up, cut["down"])
            else:  # some adapted: each projection replayed on its own
                out.update({m.gate_proj: gate, m.up_proj: up, m.down_proj: cut["down"]})
        return out
