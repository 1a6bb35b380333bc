"""Batched sampling from a policy with a KV cache: the rollout engine of the online trainers.

For P prompts and G samples each, we prefill the P (left-padded) prompts once, repeat the
cache G times, and decode token by token with a lean loop: one forward of the active rows
per step, temperature / top-k / top-p on the last logits only, and rows that finished (eos,
a stop string, or the token budget) are dropped from the cache so later steps run on fewer
rows. ``transformers.generate`` does the same sampling with more per-token machinery (logits
processors, stopping criteria objects, a padded batch to the end); for small models that
overhead is most of the time.

Sampling log-probabilities are those of the distribution actually sampled from (after
temperature, top-k and top-p); with ``temperature=1`` and no truncation they equal the
policy's log-probabilities of the tokens, up to floating-point differences between the
incremental and the full forward.

The engine is one function with a narrow contract (prompts in, :class:`Rollout` out) so a
vLLM backend can stand in its place on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from posttrain.data import pad_left
from posttrain.modeling import cache_kwarg


@dataclass
class SamplingParams:
    """How completions are sampled."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be ≥ 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("top_k must be ≥ 0 and max_new_tokens ≥ 1")


@dataclass
class Rollout:
    """``N = P·G`` sampled completions; rows of one prompt are contiguous."""

    prompt_ids: list[list[int]]
    """Token ids of each sample's prompt (no padding), length N."""
    completion_ids: torch.Tensor
    """(N, Tc) generated tokens, right-padded with the pad id."""
    completion_mask: torch.Tensor
    """(N, Tc) 1 on generated tokens (including a closing eos)."""
    logprobs: torch.Tensor
    """(N, Tc) log-probability of each generated token under the sampling distribution."""
    truncated: torch.Tensor
    """(N,) True where the token budget ran out before eos or a stop string."""
    group_ids: torch.Tensor
    """(N,) index of the prompt each sample came from."""
    texts: list[str]
    """Decoded completions without special tokens (cut at a stop string)."""
    activations: DecodeActivations | None = None
    """The outputs of the policy's projections at each completion position, saved while
    sampling (``generate(..., capture=True)``, lean engine); None when not captured."""

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)


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
            sl = slice(r[0], r[0] + len(r))
            return DecodeActivations([{k: v[sl] for k, v in d.items()} for d in self.layers])
        return DecodeActivations([{k: v[rows] for k, v in d.items()} for d in self.layers])

    def replay_map(self, model, columns: int) -> dict[torch.nn.Module, torch.Tensor | tuple]:
        """What :func:`modeling.replay_forward` takes for ``model``: each attention
        projection mapped to its saved output, each MLP to its gate, up and output, over the
        first ``columns`` completion positions."""
        out: dict[torch.nn.Module, torch.Tensor | tuple] = {}
        for layer, saved in zip(model.model.layers, self.layers, strict=True):
            a = layer.self_attn
            cut = {k: v[:, :columns] for k, v in saved.items()}
            inter = cut["gu"].shape[-1] // 2
            q = a.q_proj.out_features
            out.update({a.q_proj: cut["qk"][..., :q], a.k_proj: cut["qk"][..., q:],
                        a.v_proj: cut["v"],
                        a.o_proj: cut["o"], layer.mlp: (cut["gu"][..., :inter],
                                                        cut["gu"][..., inter:], cut["down"])})
        return out


def concat_activations(parts: list[DecodeActivations | None], T: int
                       ) -> DecodeActivations | None:
    """Several rollouts' activations as one, padded with zeros to ``T`` columns; None unless
    every part has them."""
    if not parts or any(p is None for p in parts):
        return None
    if len(parts) == 1 and all(v.shape[1] == T for d in parts[0].layers for v in d.values()):
        return parts[0]

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[1]))

    layers = [{k: torch.cat([pad(p.layers[i][k]) for p in parts]) for k in parts[0].layers[i]}
              for i in range(len(parts[0].layers))]
    return DecodeActivations(layers)


def _sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits`` (R, V); return (tokens, log-probs)."""
    logits = logits.float()
    if p.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.zeros_like(tokens, dtype=torch.float32)
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    logp = logits.log_softmax(-1)
    # Inverse-CDF sampling: one uniform number per row (torch.multinomial, or a Gumbel /
    # exponential race, draw one per vocabulary entry, which dominates a small model's step).
    cdf = logp.exp().cumsum(-1)
    # drawn on the generator's device (a CPU generator drives a CUDA policy too), then moved
    u = torch.rand(len(cdf), 1, generator=gen,
                   device=gen.device if gen is not None else cdf.device).to(cdf.device)
    u = u * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u).squeeze(-1).clamp_max(cdf.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class HFDecoder:
    """One decode step through the model's own forward, with its ``DynamicCache``. It keeps
    each row's attention mask and next position."""

    def __init__(self, model, cache, n: int, mask: torch.Tensor, pos: torch.Tensor):
        self.model, self.cache, self.kw = model, cache, cache_kwarg(model)
        cache.batch_repeat_interleave(n)
        self.mask, self.pos = mask, pos  # (N, Lp), (N,)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask, self.pos = self.mask[rows], self.pos[rows]

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tok), 1)], dim=1)
        out = self.model(input_ids=tok[:, None], attention_mask=self.mask,
                         position_ids=self.pos[:, None], use_cache=True,
                         **{self.kw: self.cache})
        self.pos = self.pos + 1
        return out.logits[:, -1]


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

    ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

    @classmethod
    def supports(cls, model) -> bool:
        """A Llama-family model whose decoder layers' projections are plain ``nn.Linear``
        (the decoder reads their weights; an adapter wrapped around one would be missed)
        and whose MLP has no biases (the fused gate/up takes none)."""
        cfg = model.config
        if not (type(model).__name__ in cls.ARCHS
                and getattr(cfg, "sliding_window", None) is None
                and getattr(cfg, "hidden_act", "silu") == "silu"
                and not getattr(cfg, "mlp_bias", False)
                and not getattr(cfg, "final_logit_softcapping", None)
                and getattr(cfg, "pretraining_tp", 1) == 1):
            return False
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            projections = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                           m.down_proj)
            if any(type(x) is not torch.nn.Linear for x in projections) or any(
                    x.bias is not None for x in projections[4:]):
                return False
        return True

    def __init__(self, model, cache, n: int, max_len: int, mask: torch.Tensor,
                 pos: torch.Tensor, capture: bool = False):
        import torch.nn.functional as F

        self.F = F
        base = model.model
        cfg = model.config
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.embed, self.norm, self.head = base.embed_tokens, _rms_norm(base.norm), model.lm_head
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            # weights transposed once (views), so a step's matmuls can write their results
            # straight into the capture buffers (``torch.mm(..., out=)``)
            wqk = torch.cat([a.q_proj.weight, a.k_proj.weight]).t()
            bqk = (torch.cat([a.q_proj.bias, a.k_proj.bias]) if a.q_proj.bias is not None
                   else None)
            wgu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).t()
            self.layers.append((
                _rms_norm(layer.input_layernorm), (wqk, bqk), (a.v_proj.weight.t(), a.v_proj.bias),
                (a.o_proj.weight.t(), a.o_proj.bias), _rms_norm(layer.post_attention_layernorm),
                (wgu, None), (m.down_proj.weight.t(), m.down_proj.bias), a.scaling))
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
            q, kv, H = self.nh * self.hd, self.nkv * self.hd, cfg.hidden_size
            gu = self.layers[0][5][0].shape[1]
            T = max_len - Lp
            # allocated in two runs, what the update's backward needs (v, gate and up) and
            # what its forward is done with layer by layer (q and k before rotation, o,
            # down), so the latter leave one contiguous free region for the backward's own
            self.saved = [{} for _ in self.layers]
            for kinds in ((("v", kv), ("gu", gu)), (("qk", q + kv), ("o", H), ("down", H))):
                for saved in self.saved:
                    for kind, features in kinds:
                        saved[kind] = k0.new_empty(T, N, features)
            self.blocks = [{k: v.unbind(0) for k, v in d.items()} for d in self.saved]

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
        for i, (n1, wqk, wv, wo, n2, wgu, wdown, scaling) in enumerate(self.layers):
            out = None
            if self.blocks:
                out = {k: v[t] if len(v[t]) == R else v[t].narrow(0, 0, R)
                       for k, v in self.blocks[i].items()}
            x = n1(h)
            qk = _linear(x, *wqk, out and out["qk"])
            v = _linear(x, *wv, out and out["v"])
            qk = self._rope(qk.view(R, nh + nkv, hd), cos, sin)  # q and k rotated in one pass
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
            g, u = _linear(n2(h), *wgu, out and out["gu"]).chunk(2, dim=-1)
            h = h + _linear(F.silu(g) * u, *wdown, out and out["down"])
        self.col = c + 1
        return self.head(self.norm(h))


def can_replay(model) -> bool:
    """Whether the update's forward may take ``model``'s projections from its lean sampler
    (:class:`DecodeActivations`): a model the lean decoder runs (plain ``nn.Linear``
    projections, a bias-free SwiGLU MLP that ``modeling.replay_forward`` knows), whose
    training forward computes what sampling computed (no dropout, no gradient
    checkpointing)."""
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True
                        for m in model.modules())
    dropout = getattr(model.config, "attention_dropout", 0.0) or any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    return LeanLlamaDecoder.supports(model) and not checkpointing and not dropout


def _compaction(live: torch.Tensor) -> torch.Tensor:
    """The rows to keep, in their new cache order, when only ``live`` (R,) rows go on: slot
    ``p`` of the first ``n = live.sum()`` keeps its row when that row is live, and a finished
    row's slot takes a live row from beyond ``n``. Only as many cache rows move as rows
    finished (keeping the live rows in order would move every row after the first one
    that finished, each step a row finishes)."""
    n = int(live.sum())
    rows = torch.arange(n, device=live.device)
    holes = (~live[:n]).nonzero().squeeze(-1)
    rows[holes] = live[n:].nonzero().squeeze(-1) + n
    return rows


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], n: int = 1,
             params: SamplingParams | None = None, generator: torch.Generator | None = None,
             engine: str = "auto", capture: bool = False) -> Rollout:
    """Sample ``n`` completions for each prompt (see the module docstring).

    ``engine``: ``lean`` decodes with :class:`LeanLlamaDecoder` (Llama-family models), ``hf``
    with the model's own forward and a ``DynamicCache``; ``auto`` picks lean when supported.
    ``capture``: keep the linear layers' outputs in ``Rollout.activations`` (lean engine
    only; None with the hf engine).
    """
    params = params or SamplingParams()
    params.validate()
    device = next(model.parameters()).device
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    P, Lp = len(prompt_ids), max(len(x) for x in prompt_ids)
    N, T = P * n, params.max_new_tokens

    ids, mask = pad_left(prompt_ids, pad_id)  # every prompt ends at column Lp - 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)

    was_training = model.training
    model.eval()
    cache = DynamicCache()
    kw = cache_kwarg(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                use_cache=True, logits_to_keep=1, **{kw: cache})
    logits = out.logits[:, -1].repeat_interleave(n, dim=0)  # (N, V)
    mask = mask.repeat_interleave(n, dim=0)
    next_pos = positions[:, -1].repeat_interleave(n) + 1
    use_lean = engine == "lean" or (engine == "auto" and LeanLlamaDecoder.supports(model))
    decoder = (LeanLlamaDecoder(model, cache, n, Lp + T, mask, next_pos, capture) if use_lean
               else HFDecoder(model, cache, n, mask, next_pos))

    tokens = torch.full((N, T), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(N, T, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    end = torch.full((N,), T - 1, dtype=torch.long, device=device)  # last step of each row
    active = None  # rows still in the cache, in cache order; None while that is all of them
    stop = params.stop
    steps = 0
    for t in range(T):
        tok, lp = _sample(logits, params, generator)
        if active is None:
            tokens[:, t], logps[:, t] = tok, lp
        else:
            tokens[active, t], logps[active, t] = tok, lp
        steps = t + 1
        finished = tok == eos_id
        if stop:
            rows = range(N) if active is None else active.tolist()
            for j, row in enumerate(rows):
                if not finished[j]:
                    text = tokenizer.decode(tokens[row, :t + 1], skip_special_tokens=True)
                    finished[j] = any(s in text for s in stop)
        if finished.any():  # the loop's one host sync per step
            rows = finished.nonzero().squeeze(-1) if active is None else active[finished]
            done[rows] = True
            end[rows] = t
            keep = _compaction(~finished)
            if len(keep) == 0 or t == T - 1:
                break
            decoder.select(keep)
            active = keep if active is None else active[keep]
            tok = tok[keep]
        if t == T - 1:
            break
        logits = decoder.step(tok)
    model.train(was_training)
    activations = decoder.activations(steps, end.clamp_max(steps - 1)) if use_lean else None

    tokens, logps = tokens[:, :steps].cpu(), logps[:, :steps].cpu()
    done, end = done.cpu(), end.cpu().clamp_max(steps - 1)
    # a row's completion runs up to and including the token that finished it (its first eos
    # or the one completing a stop string), else to the end; it is pad from there on
    cols = torch.arange(steps)
    completion_mask = (cols[None, :] <= end[:, None]).long()
    if steps == 0:
        completion_mask = completion_mask[:, :0]
    tokens = tokens.masked_fill(completion_mask == 0, pad_id)
    logps = logps.masked_fill(completion_mask == 0, 0.0)
    texts = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    if stop:
        texts = [_cut_at_stop(x, stop) for x in texts]
    return Rollout(prompt_ids=[x for x in prompt_ids for _ in range(n)],
                   completion_ids=tokens, completion_mask=completion_mask, logprobs=logps,
                   truncated=~done, group_ids=torch.arange(P).repeat_interleave(n),
                   texts=texts, activations=activations)


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def select(r: Rollout, rows: torch.Tensor) -> Rollout:
    """The samples ``rows`` (indices, in order) of a rollout; group ids are kept."""
    idx = rows.tolist()
    return Rollout(prompt_ids=[r.prompt_ids[i] for i in idx], completion_ids=r.completion_ids[rows],
                   completion_mask=r.completion_mask[rows], logprobs=r.logprobs[rows],
                   truncated=r.truncated[rows], group_ids=r.group_ids[rows],
                   texts=[r.texts[i] for i in idx],
                   activations=None if r.activations is None else r.activations.rows(rows))


def concat(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout from several; completions are re-padded to the longest, and group ids
    renumbered so groups stay distinct."""
    T = max(r.completion_ids.shape[1] for r in rollouts)

    def pad(x: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)

    offset, groups = 0, []
    for r in rollouts:
        _, ids = torch.unique(r.group_ids, return_inverse=True)
        groups.append(ids + offset)
        offset += int(ids.max()) + 1 if len(ids) else 0
    return Rollout(
        prompt_ids=[p for r in rollouts for p in r.prompt_ids],
        completion_ids=torch.cat([pad(r.completion_ids, pad_id) for r in rollouts]),
        completion_mask=torch.cat([pad(r.completion_mask, 0) for r in rollouts]),
        logprobs=torch.cat([pad(r.logprobs, 0.0) for r in rollouts]),
        truncated=torch.cat([r.truncated for r in rollouts]),
        group_ids=torch.cat(groups),
        texts=[t for r in rollouts for t in r.texts],
        activations=concat_activations([r.activations for r in rollouts], T))
