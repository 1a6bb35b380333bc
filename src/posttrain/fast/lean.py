"""The lean decoder: incremental decoding of plain Llama-family models (Llama, Qwen2,
Mistral without a window, and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE) over a
preallocated KV cache, as a short sequence of tensor ops per step, optionally capturing each
projection's output for the update to replay (:mod:`posttrain.fast.replay`; dense models
only). The rollout engine ``lean`` drives it."""

from __future__ import annotations

import torch

from posttrain.fast.replay import DecodeActivations, is_replayable_projection, lora_parts


def _rms_norm(norm):
    """``norm`` as one call: ``F.rms_norm`` for float32 Llama-style RMSNorm modules (the same
    arithmetic as their forward, in one op instead of six), else the module itself (half
    precision: the module's cast order is kept exactly)."""
    import torch.nn.functional as F

    eps, weight = getattr(norm, "variance_epsilon", None), getattr(norm, "weight", None)
    if eps is None or weight is None or weight.dtype != torch.float32:
        return norm
    shape = tuple(weight.shape)
    return lambda x: F.rms_norm(x, shape, weight, eps)

def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight_t (+ bias)``, written into ``out`` when given."""
    if bias is None:
        return torch.mm(x, weight_t, out=out)
    return torch.addmm(bias, x, weight_t, out=out)

def _weight(proj) -> torch.Tensor:
    """A projection's weight: a plain layer's own, a LoRA layer's merged ``W + s·B·A`` (a
    new tensor, built per decoder, so it always matches the adapters)."""
    parts = lora_parts(proj)
    if parts is None:
        return proj.weight
    w, a, b, s = parts  # merged in the adapters' dtype (peft keeps them float32), then cast
    return torch.addmm(w.to(a.dtype), b, a, alpha=s).to(w.dtype)

def _windowed(cfg) -> bool:
    """Whether some layer attends through a sliding window (a family with ``layer_types``
    windows only the layers it marks ``sliding_attention``)."""
    if not getattr(cfg, "sliding_window", None):
        return False
    types = getattr(cfg, "layer_types", None)
    return types is None or "sliding_attention" in types


def _dense_mlp(mlp) -> bool:
    """A SwiGLU MLP of three projections (else a mixture-of-experts block: it has a router)."""
    return all(hasattr(mlp, k) for k in ("gate_proj", "up_proj", "down_proj"))


def _layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers ≥ 4.56
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]

class LeanLlamaDecoder:
    """Incremental decoding for Llama-family models over a preallocated (static) KV cache.

    It reads the model's own modules and weights — norms, rotary tables, projections, LM
    head — but runs one decode step as a short sequence of tensor ops: the q and k
    projections fused into one matmul (v apart, so that a capture keeps v, which the
    update's backward needs, apart from q and k, which it frees), gate and up into another,
    keys and values written in place into buffers sized for the whole rollout, and no
    attention-mask construction beyond one additive row bias. Prefill stays with the
    model's forward; its cache is copied into the buffers. Exactness against the model's
    forward is tested (greedy tokens identical, log-probs to float rounding). Fused weights
    are built per call, so they always match the current policy.
    """

    ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
             "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

    @classmethod
    def supports(cls, model) -> bool:
        """A Llama-family model, or a peft LoRA model of one, whose decoder layers'
        projections are plain ``nn.Linear`` or LoRA layers over one (the decoder reads
        their weights, merging ``W + s·B·A`` per call; any other wrapper would be missed)
        and whose MLP has no biases (the fused gate/up takes none). A mixture-of-experts
        layer's block (router, experts, a shared expert) runs as its own module, and
        Qwen3-MoE's per-head q and k norms as their own modules."""
        return cls._supports(model, moe=True)

    @classmethod
    def supports_dense(cls, model) -> bool:
        """:meth:`supports`, and every layer's MLP a plain SwiGLU and its attention free of
        q/k norms (what a capture records and the update's replay recomputes)."""
        return cls._supports(model, moe=False)

    @classmethod
    def _supports(cls, model, moe: bool) -> bool:
        if hasattr(model, "get_base_model"):  # peft
            model = model.get_base_model()
        cfg = model.config
        if not (type(model).__name__ in cls.ARCHS
                and not _windowed(cfg)
                and getattr(cfg, "hidden_act", "silu") == "silu"
                and not getattr(cfg, "mlp_bias", False)
                and not getattr(cfg, "final_logit_softcapping", None)
                and getattr(cfg, "pretraining_tp", 1) == 1):
            return False
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            if hasattr(a, "q_norm") and not moe:
                return False
            projections = [a.q_proj, a.k_proj, a.v_proj, a.o_proj]
            if _dense_mlp(m):
                mlp = [m.gate_proj, m.up_proj, m.down_proj]
                if any(getattr(x, "bias", None) is not None for x in mlp):
                    return False
                projections += mlp
            elif not (moe and hasattr(m, "gate") and hasattr(m, "experts")):
                return False
            if not all(is_replayable_projection(x) for x in projections):
                return False
        return True

    def __init__(self, model, cache, n: int, max_len: int, mask: torch.Tensor,
                 pos: torch.Tensor, capture: bool = False):
        import torch.nn.functional as F

        self.F = F
        if hasattr(model, "get_base_model"):  # a peft LoRA model: its adapters merged below
            model = model.get_base_model()
        base = model.model
        cfg = model.config
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.embed, self.norm, self.head = base.embed_tokens, _rms_norm(base.norm), model.lm_head
        self.layers = []
        if capture and not self.supports_dense(model):
            raise ValueError("the lean decoder captures projections of dense models only")
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            # weights transposed once (views), so a step's matmuls can write their results
            # straight into the capture buffers (``torch.mm(..., out=)``)
            wqk = torch.cat([_weight(a.q_proj), _weight(a.k_proj)]).t()
            bqk = (torch.cat([a.q_proj.bias, a.k_proj.bias]) if a.q_proj.bias is not None
                   else None)
            # a mixture-of-experts block runs as its own module (its router's hooks fire:
            # posttrain.models.routing records and replays through them)
            mlp = (((torch.cat([_weight(m.gate_proj), _weight(m.up_proj)]).t(), None),
                    (_weight(m.down_proj).t(), m.down_proj.bias)) if _dense_mlp(m)
                   else (m, None))
            self.layers.append((
                _rms_norm(layer.input_layernorm), (wqk, bqk),
                (_weight(a.v_proj).t(), a.v_proj.bias), (_weight(a.o_proj).t(), a.o_proj.bias),
                _rms_norm(layer.post_attention_layernorm), *mlp, a.scaling,
                # Qwen3-MoE: RMSNorm over each head of q and of k, before the rotation
                (_rms_norm(a.q_norm), _rms_norm(a.k_norm)) if hasattr(a, "q_norm") else None))
        k0, _ = _layer_kv(cache, 0)
        P, _, Lp, _ = k0.shape
        N = P * n
        self.k = k0.new_zeros(len(self.layers), N, self.nkv, max_len, self.hd)
        self.v = torch.zeros_like(self.k)
        for i in range(len(self.layers)):
            k, v = _layer_kv(cache, i)
            self.k[i, :, :, :Lp] = k.repeat_interleave(n, dim=0)
            self.v[i, :, :, :Lp] = v.repeat_interleave(n, dim=0)
        self.col = self.start = Lp  # next cache column (prompts are left-padded to Lp)
        self.rows = N
        # per row: the additive attention bias over every cache column, already repeated per
        # head (left padding -inf, all else 0), built once; a step only slices it
        dtype = self.k.dtype
        bias = torch.zeros(N, max_len, dtype=dtype, device=k0.device)
        bias[:, :Lp].masked_fill_(mask == 0, float("-inf"))
        self.bias = bias.repeat_interleave(self.nh, dim=0)[:, None]  # (N·nh, 1, max_len)
        positions = torch.arange(max_len, device=k0.device)[None]
        cos, sin = base.rotary_emb(k0, position_ids=positions)  # (1, max_len, hd)
        # rotate_half(x) = (-x2, x1) is x rolled by half a head with the first half negated:
        # the sign goes into sin once, so a step rotates with one roll and an addcmul
        half = self.hd // 2
        sign = torch.ones(self.hd, dtype=sin.dtype, device=sin.device)
        sign[:half] = -1
        self.cos, self.sin = cos[0], sin[0] * sign
        self.pos = pos  # (N,) position of each row's first decode step
        # with ``capture``, each projection writes its output for step t straight into
        # block t of a time-major buffer (:class:`DecodeActivations`), at the cache slots of
        # the rows then active; once rows have moved, ``moves`` records each mapping of
        # cache slots to samples and the step from which it held
        self.moves: list[tuple[int, torch.Tensor]] = []
        self.saved: list[dict[str, torch.Tensor]] | None = None
        self.blocks: list[dict[str, tuple[torch.Tensor, ...]]] = []
        if capture:
            self.saved = self._capture_buffers(k0, cfg.hidden_size, N, max_len - Lp)
            self.blocks = [{k: v.unbind(0) for k, v in d.items()} for d in self.saved]

    def _capture_buffers(self, like: torch.Tensor, H: int, N: int, T: int):
        """Per layer, a ``(T, N, features)`` buffer for each projection's output. Allocated
        in two runs, what the update's backward needs (v, gate and up) and what its forward
        is done with layer by layer (q and k before rotation, o, down), so the latter leave
        one contiguous free region for the backward's own."""
        q, kv = self.nh * self.hd, self.nkv * self.hd
        gu = self.layers[0][5][0].shape[1]
        saved: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]
        for kinds in ((("v", kv), ("gu", gu)), (("qk", q + kv), ("o", H), ("down", H))):
            for buffers in saved:
                for kind, features in kinds:
                    buffers[kind] = like.new_empty(T, N, features)
        return saved

    def activations(self, columns: int, end: torch.Tensor) -> DecodeActivations | None:
        """The captured outputs over the first ``columns`` completion positions, sample by
        sample. ``end`` (N,): the last token of each sample, never fed to the model, so its
        column and those after it were never written: they are zeroed (finite, and unread
        by a loss)."""
        if self.saved is None:
            return None
        N = len(end)
        src, dst = self._moved(columns, N, end.device)
        cols = torch.arange(columns, device=end.device)
        t, row = (cols[:, None] >= end[None, :]).nonzero(as_tuple=True)
        for d in self.saved:
            for v in d.values():
                if src is not None:
                    flat = v.view(-1, v.shape[-1])
                    flat.index_copy_(0, dst, flat[src])
                v[t, row] = 0
        return DecodeActivations([{k: v[:columns].transpose(0, 1) for k, v in d.items()}
                                  for d in self.saved])

    def _moved(self, columns: int, N: int, device) -> tuple[torch.Tensor | None, ...]:
        """Where the outputs of rows that moved to another cache slot were written, and
        where they belong (flat ``t·N + slot`` indices of the buffers); None, None if no row
        moved. :func:`_compaction` moves few rows: the live ones from the tail into the
        finished ones' slots, which the step's writes then stop using; a slot past the
        active rows is never written again, so each moved entry's destination is free."""
        if not self.moves:
            return None, None
        done = min(columns, self.col - self.start)  # steps that ran
        src, dst = [], []
        ends = [t for t, _ in self.moves[1:]] + [done]
        for (t0, slots), t1 in zip(self.moves, ends, strict=True):
            t1 = min(t1, done)
            moved = (slots != torch.arange(len(slots), device=device)).nonzero().squeeze(-1)
            if t1 > t0 and len(moved):
                steps = torch.arange(t0, t1, device=device)[:, None] * N
                src.append((steps + moved).reshape(-1))
                dst.append((steps + slots[moved]).reshape(-1))
        if not src:
            return None, None
        return torch.cat(src), torch.cat(dst)

    def select(self, rows: torch.Tensor) -> None:
        n, c = len(rows), self.col  # only the columns written so far are worth moving
        # only the slots whose row changes are copied: with :func:`_compaction` those are the
        # finished rows' slots, refilled from the tail, not the whole cache
        dst = (rows != torch.arange(n, device=rows.device)).nonzero().squeeze(-1)
        if len(dst):
            src = rows[dst]
            self.k[:, dst, :, :c] = self.k[:, src, :, :c]
            self.v[:, dst, :, :c] = self.v[:, src, :, :c]
            per_row = self.bias.view(-1, self.nh, self.bias.shape[-1])  # (rows, nh, max_len)
            per_row[dst] = per_row[src]
            self.pos = self.pos.clone()
            self.pos[dst] = self.pos[src]
        self.bias = self.bias[:n * self.nh]
        self.pos = self.pos[:n]
        self.rows = n
        if self.saved is not None:
            slots = rows if not self.moves else self.moves[-1][1][rows]
            self.moves.append((self.col - self.start, slots))

    def kv(self, slots: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of cache ``slots`` over the first ``columns`` columns,
        ``(layers, len(slots), kv heads, columns, head dim)`` each (views)."""
        return self.k[:, slots, :, :columns], self.v[:, slots, :, :columns]

    def _rope(self, x, cos, sin):  # x (R, heads, hd); cos/sin (R, 1, hd), sin signed
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        F, R, c = self.F, self.rows, self.col
        nh, nkv, hd = self.nh, self.nkv, self.hd
        h = self.embed(tok)  # (R, H)
        at = self.pos + (c - self.start)
        cos, sin = self.cos[at][:, None], self.sin[at][:, None]  # (R, 1, hd)
        bias = self.bias[:, :, :c + 1]  # (R·nh, 1, c+1)
        t = c - self.start  # the completion token fed: capture block t
        for i, (n1, wqk, wv, wo, n2, wgu, wdown, scaling, qkn) in enumerate(self.layers):
            out = None
            if self.blocks:
                out = {k: v[t] if len(v[t]) == R else v[t].narrow(0, 0, R)
                       for k, v in self.blocks[i].items()}
            x = n1(h)
            qk = _linear(x, *wqk, out and out["qk"])
            v = _linear(x, *wv, out and out["v"])
            qk = qk.view(R, nh + nkv, hd)
            if qkn is not None:
                qk = torch.cat([qkn[0](qk[:, :nh]), qkn[1](qk[:, nh:])], dim=1)
            qk = self._rope(qk, cos, sin)  # q and k rotated in one pass
            self.k[i, :R, :, c] = qk[:, nh:]
            self.v[i, :R, :, c] = v.view(R, nkv, hd)
            K, V = self.k[i, :R, :, :c + 1], self.v[i, :R, :, :c + 1]  # (R, nkv, c+1, hd)
            if nkv != nh:
                K = K.repeat_interleave(nh // nkv, dim=1)
                V = V.repeat_interleave(nh // nkv, dim=1)
            # one query per row: two batched matmuls beat SDPA's blocked kernel at this size
            K, V = K.reshape(R * nh, c + 1, hd), V.reshape(R * nh, c + 1, hd)
            scores = torch.baddbmm(bias, qk[:, :nh].reshape(R * nh, 1, hd), K.transpose(1, 2),
                                   alpha=scaling)
            a = torch.bmm(scores.softmax(-1), V)  # (R·nh, 1, hd)
            h = h + _linear(a.view(R, nh * hd), *wo, out and out["o"])
            if isinstance(wgu, torch.nn.Module):  # a mixture-of-experts block
                h = h + wgu(n2(h)[:, None]).view(R, -1)
                continue
            g, u = _linear(n2(h), *wgu, out and out["gu"]).chunk(2, dim=-1)
            h = h + _linear(F.silu(g) * u, *wdown, out and out["down"])
        self.col = c + 1
        return self.head(self.norm(h))
