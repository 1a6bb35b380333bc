"""Per-token log-probabilities and entropy from logits, without a full-vocabulary copy.

``log_softmax(logits).gather(labels)`` writes a second ``(B, T, V)`` tensor (2.5 GB for
B=8, T=512 and Qwen's 151,936-token vocabulary in float32) and, under autograd, keeps it for
the backward pass. Here we gather the chosen token's logit and subtract a ``logsumexp``, a
chunk of rows at a time:

    ℓ_t = logits[t, y_t] - logsumexp_v logits[t, v]
    H_t = -Σ_v p_v (logits[t, v] - logsumexp_v logits[t, v]),   p = softmax(logits[t])

Both are ``torch.autograd.Function`` s with a hand-written, equally chunked backward:

    ∂ℓ_t/∂logits[t, v] = 1[v = y_t] - p_v
    ∂H_t/∂logits[t, v] = -p_v (logits[t, v] - E_p[logits[t]]) = -p_v (log p_v + H_t)

so autograd saves only the logits (no copy) and one float per row, and the backward writes
the logits' gradient straight into one buffer. (Slicing chunks out of a tensor that requires
grad would instead make autograd allocate a full-size zero gradient per chunk.) Half-precision
logits are upcast to float32 one chunk at a time; outputs are float32 (float64 for float64).
Chunks are views: slicing the time axis of a non-contiguous tensor (``logits[:, :-1]``)
copies nothing.
"""

from __future__ import annotations

import torch

# Elements per chunk: 4 MiB of float32 on the CPU keeps the temporaries in cache and the
# extra memory negligible; on a GPU larger chunks amortise kernel launches.
CHUNK_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 24}


def _chunks(logits: torch.Tensor, chunk_rows: int | None):
    """Index tuples ``(b, slice(t0, t1))`` covering ``(B, T)`` a chunk of rows at a time."""
    B, T, V = logits.shape
    rows = chunk_rows or max(1, CHUNK_ELEMENTS.get(logits.device.type, 1 << 22) // V)
    return [(b, slice(t0, min(T, t0 + rows))) for b in range(B) for t0 in range(0, T, rows)]


def _out_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, chunk_rows):  # logits (B, T, V), labels (B, T) >= 0
        B, T, _ = logits.shape
        dtype = _out_dtype(logits)
        out = torch.empty(B, T, dtype=dtype, device=logits.device)
        lse = torch.empty(B, T, dtype=dtype, device=logits.device)
        for i in _chunks(logits, chunk_rows):
            x = logits[i].to(dtype)  # (rows, V); a view when no upcast
            lse[i] = torch.logsumexp(x, dim=-1)
            out[i] = x.gather(-1, labels[i][:, None]).squeeze(-1) - lse[i]
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i in _chunks(logits, ctx.chunk_rows):
            g = grad_out[i][:, None].to(lse.dtype)  # (rows, 1)
            x = logits[i].to(lse.dtype)
            chunk = torch.exp(x - lse[i][:, None]).mul_(-g)  # -p · g
            chunk.scatter_add_(-1, labels[i][:, None], g)  # + 1[v = y] · g
            grad[i] = chunk
        return grad, None, None


class _TokenEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, chunk_rows):
        B, T, _ = logits.shape
        dtype = _out_dtype(logits)
        out = torch.empty(B, T, dtype=dtype, device=logits.device)
        lse = torch.empty(B, T, dtype=dtype, device=logits.device)
        # H = -Σ p log p with log p = logits - lse, not lse - Σ p·logits: the latter's error is
        # |logits| · |Σ p - 1| ≈ |logits|² · eps (1.5 nats for float32 logits near 1e4, and it
        # grows with a constant shift of the logits, which leaves H unchanged).
        for i in _chunks(logits, chunk_rows):
            x = logits[i].to(dtype)
            lse[i] = torch.logsumexp(x, dim=-1)
            logp = x - lse[i][:, None]
            out[i] = -(torch.exp(logp) * logp).sum(-1)
        ctx.save_for_backward(logits, lse, out.clone())  # a copy: callers may edit `out`
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, lse, ent = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i in _chunks(logits, ctx.chunk_rows):
            logp = logits[i].to(lse.dtype) - lse[i][:, None]
            p = torch.exp(logp)
            # logits - E_p[logits] = log p + H
            g = grad_out[i][:, None].to(lse.dtype)
            grad[i] = p.mul_(logp.add_(ent[i][:, None])).mul_(-g)
        return grad, None


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """``log softmax(logits)[..., labels]``: logits ``(B, T, V)`` or ``(N, V)``, labels ``(B, T)``
    or ``(N,)`` → ``(B, T)`` / ``(N,)`` in float32 (float64 for float64 logits).

    Naive equivalent: ``logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)``.
    Negative labels (the usual ``-100`` for ignored positions) give 0 and no gradient.
    """
    squeeze = logits.dim() == 2
    if squeeze:
        logits, labels = logits.unsqueeze(0), labels.unsqueeze(0)
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"expected logits (B, T, V) and labels (B, T), got "
                         f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    ignored = labels < 0
    out = _TokenLogprobs.apply(logits, labels.clamp_min(0), chunk_rows)
    out = out.masked_fill(ignored, 0.0)
    return out.squeeze(0) if squeeze else out


def token_entropy(logits: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position: ``(B, T, V)`` → ``(B, T)`` (or ``(N, V)`` →
    ``(N,)``), float32 (float64 for float64 logits).

    Naive equivalent: ``-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)``.
    """
    squeeze = logits.dim() == 2
    out = _TokenEntropy.apply(logits.unsqueeze(0) if squeeze else logits, chunk_rows)
    return out.squeeze(0) if squeeze else out


# --- log-probs straight from hidden states ----------------------------------------------------

# Logits per chunk of the fused head: each chunk is a (rows, H) × (H, V) matmul, and the
# weight gradient's (V, rows) × (rows, H) needs rows in the hundreds to run at the machine's
# matmul rate (a few rows per chunk of a large-vocabulary head leave the matmuls
# memory-bound: each chunk re-reads the whole (V, H) weight), so chunks are larger than the
# reductions' above: on the CPU 32M float32 logits (128 MiB; 220 rows at V = 151,936),
# small against the full logits of a batch of thousands of rows. docs/benchmarks.md has
# the measurements behind the CPU figure.
HEAD_CHUNK_ELEMENTS = {"cpu": 1 << 25, "cuda": 1 << 26}

def head_logit_transform(logits: torch.Tensor, scale: float = 1.0, divide: float = 1.0,
                         softcap: float = 0.0, temperature: float = 1.0) -> torch.Tensor:
    """The logits a head's output becomes: ``× scale``, ``÷ divide``, then
    ``softcap · tanh(· / softcap)`` (when ``softcap`` > 0), then ``÷ temperature``."""
    if scale != 1.0:
        logits = logits * scale
    if divide != 1.0:
        logits = logits / divide
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    return logits


class _HeadLogprobs(torch.autograd.Function):
    """ℓ = log softmax(T(h Wᵀ + b))[y] over row chunks of ``h``: the chunk's logits exist
    only while it is computed (forward) and recomputed in the backward, where

        ∂ℓ/∂z = 1[v = y] − p,   z = T(l): ∂z/∂l = (scale / divide) · (1 − tanh²) / temperature,
        ∂ℓ/∂h = (∂ℓ/∂l) W,  ∂ℓ/∂W = (∂ℓ/∂l)ᵀ h,  ∂ℓ/∂b = Σ_rows ∂ℓ/∂l.

    Saved for the backward: ``h``, ``W`` (already held by the model), the labels and one
    log-sum-exp per row. The entropy is returned alongside, without gradient (a metric).

    Each pass works in one chunk-sized buffer, reused from chunk to chunk with in-place ops
    (two with the entropy): a fresh chunk-sized tensor per op would be a fresh allocation
    each time, and on the CPU one this large is a fresh mapping, page-faulted anew."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, transform, rows, with_entropy, known):
        N, V = hidden.shape[0], weight.shape[0]
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        ctx.transform, ctx.rows, ctx.renormalise = transform, rows, known is not None
        if known is not None:  # the label's logit only, against the known lse
            lse = known[0].to(dtype)
            picked = (hidden.to(dtype) * weight[labels].to(dtype)).sum(-1)  # (N,)
            if bias is not None:
                picked = picked + bias[labels].to(dtype)
            out = head_logit_transform(picked, *transform) - lse
            ent = known[1].to(dtype) if with_entropy else out.new_empty(0)
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
            ctx.mark_non_differentiable(ent)
            return out, ent
        out = torch.empty(N, dtype=dtype, device=hidden.device)
        lse = torch.empty(N, dtype=dtype, device=hidden.device)
        ent = torch.empty(N if with_entropy else 0, dtype=dtype, device=hidden.device)
        buf = torch.empty(min(rows, N), V, dtype=dtype, device=hidden.device)
        ebuf = torch.empty_like(buf) if with_entropy else None
        for s in range(0, N, rows):
            z = _chunk_logits(hidden[s:s + rows], weight, bias, transform, buf)
            top = z.amax(-1)
            z.sub_(top[:, None])  # z − max: exp cannot overflow
            picked = z.gather(-1, labels[s:s + rows, None]).squeeze(-1)
            if with_entropy:
                e = torch.exp(z, out=ebuf[:len(z)])
                total = e.sum(-1)
                # H = log Σe − Σ e·(z − max) / Σe
                ent[s:s + rows] = total.log() - e.mul_(z).sum(-1) / total
            else:
                total = z.exp_().sum(-1)
            log_total = total.log()
            lse[s:s + rows] = top + log_total
            out[s:s + rows] = picked - log_total
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_ent):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        scale, divide, softcap, temperature = ctx.transform
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=lse.dtype) if want_w else None
        grad_b = (torch.zeros_like(bias, dtype=lse.dtype) if want_b and bias is not None
                  else None)
        N = hidden.shape[0]
        buf = torch.empty(min(ctx.rows, N), weight.shape[0], dtype=lse.dtype,
                          device=hidden.device)
        for s in range(0, N, ctx.rows):
            h = hidden[s:s + ctx.rows]
            z = _chunk_logits(h, weight, bias, ctx.transform, buf)
            g = grad_out[s:s + ctx.rows, None].to(lse.dtype)
            # z·T = softcap · tanh(u): ∂/∂u = 1 − tanh²(u), taken before z becomes p
            cap = (z * (temperature / softcap)).square_().neg_().add_(1) if softcap else None
            d = z.sub_(lse[s:s + ctx.rows, None]).exp_()
            if ctx.renormalise:  # p of these very logits, whatever the given lse rounded
                d.div_(d.sum(-1, keepdim=True))
            d.mul_(-g)  # −p · g, in place
            d.scatter_add_(-1, labels[s:s + ctx.rows, None], g)  # + 1[v = y] · g
            if temperature != 1.0:
                d.div_(temperature)
            if cap is not None:
                d.mul_(cap)
            if scale / divide != 1.0:
                d.mul_(scale / divide)
            if want_h:
                grad_h[s:s + ctx.rows] = (d @ weight.to(d.dtype)).to(hidden.dtype)
            if want_w:
                grad_w.addmm_(d.t(), h.to(d.dtype))
            if grad_b is not None:
                grad_b.add_(d.sum(0))
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None)


def _chunk_logits(h, weight, bias, transform, buf: torch.Tensor) -> torch.Tensor:
    """The transformed logits of the rows ``h``, written into (the first rows of) ``buf``."""
    z = buf[:h.shape[0]]
    if h.dtype == buf.dtype and weight.dtype == buf.dtype:
        if bias is None:
            torch.mm(h, weight.t(), out=z)
        else:
            torch.addmm(bias.to(buf.dtype), h, weight.t(), out=z)
    else:  # a half-precision head: its matmul in its dtype, the rest in float32
        z.copy_(torch.nn.functional.linear(h, weight, bias))
    scale, divide, softcap, temperature = transform
    if scale != 1.0:  # the same operations, in the same order, as head_logit_transform
        z.mul_(scale)
    if divide != 1.0:
        z.div_(divide)
    if softcap:
        z.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def head_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        bias: torch.Tensor | None = None, scale: float = 1.0,
                        divide: float = 1.0, softcap: float = 0.0, temperature: float = 1.0,
                        with_entropy: bool = False, chunk_rows: int | None = None,
                        known: torch.Tensor | None = None):
    """Per-token log-probs ``(N,)`` of ``labels`` under the head ``weight`` ``(V, H)``
    (and ``bias``) applied to ``hidden`` ``(N, H)`` with :func:`head_logit_transform`,
    computed a chunk of rows at a time in the forward and the backward, so no ``(N, V)``
    tensor is ever held (see :class:`_HeadLogprobs`). With ``with_entropy`` also the
    entropy ``(N,)``, without gradient.

    ``known`` ``(2, N)``: each row's log-sum-exp and entropy of these logits when they are
    known already (computed elsewhere from the same weights and hidden states): the
    forward then takes only the label's logit, ``h·W[y]``, and returns the given entropy,
    so the head costs three matmuls over the vocabulary instead of four. The backward,
    which recomputes the logits anyway, normalises their softmax itself, so the gradient is
    log-softmax's at these logits, not at the given log-sum-exp's rounding of them.

    Naive equivalent: ``token_logprobs(head_logit_transform(hidden @ weight.T + bias, ...),
    labels)``."""
    V = weight.shape[0]
    rows = chunk_rows or max(1, HEAD_CHUNK_ELEMENTS.get(hidden.device.type, 1 << 25) // V)
    out, ent = _HeadLogprobs.apply(hidden, weight, bias, labels,
                                   (float(scale), float(divide), float(softcap or 0.0),
                                    float(temperature)), rows, with_entropy, known)
    return (out, ent) if with_entropy else out
