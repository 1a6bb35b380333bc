"""Loading and running Hugging Face models: causal LMs for policies, scalar-head models for
rewards, and the per-token log-probabilities of completions.

``trust_remote_code`` is off unless the caller turns it on. Weights are read and written as
safetensors; everything is saved as a Hugging Face directory that plain ``transformers``
loads.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from posttrain.core import token_entropy, token_logprobs

log = logging.getLogger(__name__)

BUILTIN = "builtin"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def builtin_model_dir() -> Path:
    """The shipped default model (see ``posttrain.builtin.build``)."""
    return Path(__file__).parent / "builtin" / "model"


def resolve(name: str) -> str:
    """``"builtin"`` → the shipped model's directory; anything else is a path or a hub id."""
    if name == BUILTIN:
        path = builtin_model_dir()
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"the built-in model is missing from {path}; rebuild it with "
                "`python -m posttrain.builtin.build`")
        return str(path)
    return name


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_tokenizer(name: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(resolve(name), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer of {name} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(name: str, dtype: str = "float32", device: str = "auto",
                   trust_remote_code: bool = False) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        resolve(name), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    model = model.to(pick_device(device))
    eager_attention_for_short_inputs(model)
    return model


# On the CPU, for a short key length the model's eager attention (two matmuls and a softmax)
# is faster than SDPA's CPU kernel; for long ones SDPA wins and eager's L×L scores cost
# memory. Forward + backward, causal, 2 threads: 2.6 against 8.8 ms at 38 keys (64 rows × 4
# heads of 32), 23 against 30 ms at 64 keys, 34 against 38 ms at 128 (8 heads of 64), and
# 118 against 56 ms at 256. A GRPO step of the 0.5M benchmark model: 4.8% faster.
EAGER_ATTENTION_MAX_KEYS = 128


def attention_for_keys(model: PreTrainedModel, keys: int) -> str:
    """Set (and return) the attention implementation a forward over ``keys`` key positions
    uses on a model prepared by :func:`eager_attention_for_short_inputs`: ``eager`` up to
    :data:`EAGER_ATTENTION_MAX_KEYS` while the model is on the CPU, else ``sdpa``. Other
    models are left as they are."""
    if not getattr(model, "_posttrain_short_eager", False):
        return model.config._attn_implementation
    on_cpu = next(model.parameters()).device.type == "cpu"  # it may have moved since
    impl = "eager" if on_cpu and keys <= EAGER_ATTENTION_MAX_KEYS else "sdpa"
    if model.config._attn_implementation != impl:
        model.set_attn_implementation(impl)
    return impl


def eager_attention_for_short_inputs(model: PreTrainedModel) -> bool:
    """On the CPU, have a model that uses SDPA attention switch to its eager attention for
    every forward call whose key length (cached positions + new ones) is at most
    :data:`EAGER_ATTENTION_MAX_KEYS`, and back for longer ones: a forward pre-hook on its
    base model decides per call. The two compute the same attention (equal to float
    rounding, tested). Returns whether the hook was installed (CPU, SDPA, a ``transformers``
    that can switch)."""
    base = getattr(model, "base_model", None)
    if (next(model.parameters()).device.type != "cpu" or base is None
            or getattr(model.config, "_attn_implementation", None) != "sdpa"
            or not hasattr(model, "set_attn_implementation")
            or getattr(model, "_posttrain_short_eager", False)):
        return False
    kwarg = cache_kwarg(base)

    def pick(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            return
        cache = kwargs.get(kwarg, kwargs.get("past_key_values"))
        past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        attention_for_keys(model, past + ids.shape[1])

    model._posttrain_short_eager = True
    base.register_forward_pre_hook(pick, with_kwargs=True)
    return True


def load_reward_model(name: str, tokenizer: PreTrainedTokenizerBase, dtype: str = "float32",
                      device: str = "auto", trust_remote_code: bool = False) -> PreTrainedModel:
    """A sequence-classification model with one output: a ``*ForSequenceClassification``
    checkpoint as it is, or a causal-LM checkpoint whose backbone gets a fresh scalar head."""
    model = AutoModelForSequenceClassification.from_pretrained(
        resolve(name), num_labels=1, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model = model.to(pick_device(device))
    eager_attention_for_short_inputs(model)
    return model


def compile_unsupported(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device`` here, or None when it can."""
    import importlib.util
    import shutil

    if device.type == "cpu":
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return "no C++ compiler on PATH (torch.compile builds its CPU kernels with one)"
        try:  # a compiler alone is not enough (Python headers, OpenMP): build one kernel now
            torch.compile(lambda x: (x * 2).sin(), dynamic=False)(torch.ones(4))
        except Exception as e:  # any build failure, reported instead of failing mid-run
            return f"a trial torch.compile failed on this machine: {e}"
        return None
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "triton is not installed"
    return f"torch.compile is not supported here on {device.type}"


def compile_pointwise_blocks(model: torch.nn.Module) -> int:
    """Compile, in place and for dynamic shapes, every RMSNorm and MLP block of ``model``.

    These blocks are pure tensor functions in ``transformers``' model code (no cache, no
    mask), and most of their time on a CPU is memory-bound elementwise work — the norm's six
    ops, SiLU times up — in the forward and again in the backward, which the compiled
    kernels fuse. Attention, rotary embeddings and the cache stay in eager code. Parameters,
    ``state_dict`` keys and saved files are unchanged; values and gradients match eager to
    float rounding (tested). Returns the number of modules compiled (already compiled ones
    are left alone).
    """
    n = 0
    for module in model.modules():
        name = type(module).__name__
        if not (name.endswith("RMSNorm") or name.endswith("MLP")):
            continue
        if getattr(module, "_compiled_call_impl", None) is None:
            module.compile(dynamic=True)
            n += 1
    return n


def has_plain_head(model: PreTrainedModel) -> bool:
    """Whether logits are exactly ``lm_head(last_hidden_state)`` (no soft-capping/scaling),
    so we may apply the head to the positions we need only."""
    cfg = model.config
    return (getattr(cfg, "final_logit_softcapping", None) is None
            and getattr(cfg, "logit_scale", None) in (None, 1.0)
            and model.get_output_embeddings() is not None)


def _scatter_logprobs(logits: torch.Tensor, labels: torch.Tensor, target: torch.Tensor,
                      with_entropy: bool):
    """Log-probs of ``labels`` from packed ``logits`` ``(N, V)``, written back to the
    positions ``target`` marks (0 elsewhere); optionally the entropy too, without gradient."""
    lp = token_logprobs(logits, labels)  # (N,)
    out = torch.zeros(target.shape, dtype=lp.dtype, device=lp.device).masked_scatter(target, lp)
    if not with_entropy:
        return out
    with torch.no_grad():
        ent = token_entropy(logits.detach())
    return out, torch.zeros_like(out).masked_scatter(target, ent)


def completion_logprobs(model: PreTrainedModel, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                        with_entropy: bool = False):
    """Log-probabilities of the tokens marked by ``loss_mask``, ``(B, T-1)``.

    ``input_ids``, ``attention_mask``, ``loss_mask`` are ``(B, T)``; entry ``t`` of the result
    is ``log π(input_ids[t+1] | input_ids[≤t])`` where ``loss_mask[t+1]`` is set, else 0. The
    LM head runs only at those positions: prompt and padding positions never become logits.
    With ``with_entropy`` it also returns the policy's entropy at the same positions
    ``(B, T-1)``, computed without gradient from the same logits (a metric).
    """
    target = loss_mask[:, 1:].bool()  # (B, T-1)
    labels = input_ids[:, 1:][target]  # (N,)
    if has_plain_head(model):
        hidden = completion_hidden(model, input_ids, attention_mask, loss_mask)
        logits = model.get_output_embeddings()(hidden)  # (N, V)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       use_cache=False).logits[:, :-1][target]
    return _scatter_logprobs(logits, labels, target, with_entropy)


def completion_hidden(model: PreTrainedModel, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states at the positions that predict the tokens ``loss_mask`` marks,
    ``(N, H)`` in row-major order of ``loss_mask[:, 1:]``: what an LM head turns into
    log-probs and a critic's value head into values ``V(x, y_<t)``."""
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              use_cache=False).last_hidden_state  # (B, T, H)
    return hidden[:, :-1][loss_mask[:, 1:].bool()]


@functools.cache
def _cache_kwarg_for(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(module: torch.nn.Module) -> str:
    """Name of the KV-cache argument of ``module.forward``: transformers ≥ 5.24 renamed
    ``past_key_values`` to ``cache``; older releases know only the former."""
    return _cache_kwarg_for(type(module))


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


@contextlib.contextmanager
def replay_forward(outputs: dict[torch.nn.Module, torch.Tensor | tuple] | None):
    """Within the block, each module in ``outputs`` returns its given output instead of
    computing it, with the gradients of the real module: a forward whose matmuls were
    already computed elsewhere (the sampler's, see ``rollout.DecodeActivations``) costs only
    its other ops. A ``nn.Linear`` maps to its output; a SwiGLU MLP (``gate_proj``,
    ``up_proj``, ``down_proj`` without biases, SiLU) to ``(gate output, up output, MLP
    output)``, and keeps less for its backward than autograd would (``_ReplayedSwiGLU``).

    The caller vouches that the outputs are what the modules would compute on this call's
    inputs (same weights, same tokens); a call whose input shape does not match its
    output's, or a module called twice, raises. Each output is taken out of ``outputs``
    when its module runs, so one that the backward does not need is freed as soon as the
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
                return _ReplayedSwiGLU.apply(x, module.gate_proj.weight, module.up_proj.weight,
                                             module.down_proj.weight, *y)
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


def shared_prompt_logprobs(model: PreTrainedModel, prompt_ids: torch.Tensor,
                           prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                           completion_mask: torch.Tensor,
                           prompt_index: torch.Tensor | None = None,
                           with_entropy: bool = False, packed: bool | None = None,
                           replay: dict[torch.nn.Module, torch.Tensor] | None = None):
    """Log-probabilities of ``k`` completions per prompt with the prompt run once.

    ``prompt_ids``/``prompt_mask`` are ``(B, Lp)``, *left*-padded; ``completion_ids``/
    ``completion_mask`` are ``(k·B, Lc)``, right-padded, in blocks: rows ``j·B + i`` are
    completions of prompt ``i``. Returns ``(k·B, Lc)``: entry ``t`` is
    ``log π(completion[t] | prompt, completion[<t])``, 0 where the mask is 0.

    The prompt's keys and values are computed once and shared (with gradient) by its ``k``
    completions, so for DPO (k = 2) the prompt tokens cost one forward and backward instead
    of two. Equals :func:`completion_logprobs` on the concatenated sequences.
    ``prompt_index`` ``(k·B,)`` overrides the block layout: row ``r`` continues prompt
    ``prompt_index[r]`` (GRPO groups, any subset of them). ``with_entropy`` also returns the
    entropy at the same positions (no gradient).

    Two ways to run it (``packed``; ``None`` picks by cost, see :func:`packing_pays`):

    - *packed*: one forward call. Row ``i`` holds prompt ``i`` followed by all its
      completions, without padding between them; a 4-D attention mask lets each completion
      see the prompt and itself only, and position ids restart after the prompt for each
      completion. Every weight is read once and its gradient is one matmul, at the price of
      a dense attention over the whole row (wasted on masked entries).
    - *two calls*: the prompts, then the completions over a KV cache of the prompts repeated
      to each completion. Attention is exact-sized, but each weight is used twice.

    ``replay``: the outputs of the linear layers and MLPs for the completion call
    (:func:`replay_forward`), which then takes the two-call path and skips those matmuls.
    """
    if not has_plain_head(model):
        raise ValueError("shared_prompt_logprobs needs logits = lm_head(hidden states)")
    hidden = shared_prompt_hidden(model, prompt_ids, prompt_mask, completion_ids,
                                  completion_mask, prompt_index, packed, replay)
    logits = model.get_output_embeddings()(hidden)  # (N, V)
    target = completion_mask.bool()
    return _scatter_logprobs(logits, completion_ids[target], target, with_entropy)


def shared_prompt_hidden(model: PreTrainedModel, prompt_ids: torch.Tensor,
                         prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                         completion_mask: torch.Tensor,
                         prompt_index: torch.Tensor | None = None,
                         packed: bool | None = None,
                         replay: dict[torch.nn.Module, torch.Tensor] | None = None
                         ) -> torch.Tensor:
    """The hidden states behind :func:`shared_prompt_logprobs` (same arguments): the last
    hidden state predicting each completion token, ``(N, H)`` in row-major order of
    ``completion_mask``. Works for any model with a ``base_model`` (a critic's too)."""
    B = prompt_ids.shape[0]
    k = completion_ids.shape[0] // B
    rows = (torch.arange(B, device=prompt_ids.device).repeat(k) if prompt_index is None
            else prompt_index)  # (kB,) prompt of each row
    if replay:
        packed = False
    elif packed is None:
        packed = packing_pays(model, prompt_mask, completion_mask, rows)
    target = completion_mask.bool()
    if packed:
        return _packed_hidden(model, prompt_ids, prompt_mask, completion_ids, target, rows)
    return _two_call_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                            rows, replay)[target]


PACKABLE_ATTENTION = ("sdpa", "eager")

# When the prompts cannot go into one packed call (the attention takes no 4-D mask, or the
# packed rows would be too long), sharing them costs a second forward call, which below this
# size costs more than the prompt tokens it saves (DPO speed-up over TRL measured on 2 CPU
# cores, two-call shared vs full sequences: 0.87x vs 1.07x at 0.5M parameters, 1.31x vs
# 1.10x at 25M). The trainers' automatic share_prompt reads it.
SHARE_PROMPT_MIN_PARAMS = 2_000_000


def packs_shared_prompts(model: PreTrainedModel) -> bool:
    """Whether the model's attention takes the custom 4-D mask of the packed layout."""
    return getattr(model.config, "_attn_implementation", None) in PACKABLE_ATTENTION


# What the two-call path costs on top of the packed one, in tokens' worth of matmul work:
# every weight is used twice, so its gradient is two matmuls plus an add, and a second
# forward call is launched. Measured on 2 CPU cores for DPO pairs of ~14 tokens (25M
# parameters, 16 pairs): two calls 0.50 s/step, packed 0.41 s/step — about 130 tokens.
TWO_CALL_OVERHEAD_TOKENS = 128


def packing_pays(model, prompt_mask, completion_mask, rows) -> bool:
    """Whether one packed call is cheaper than two calls: the attention implementation takes
    a custom 4-D mask, and the dense attention over the packed rows (≈ 4·L²·d·layers FLOPs
    per row, most of it on masked entries when a prompt has many completions) costs less
    than :data:`TWO_CALL_OVERHEAD_TOKENS` tokens of matmuls (2·N per token). DPO pairs pack;
    GRPO groups of 8 completions of 32 tokens (rows of ~260) take two calls."""
    cfg = model.config
    if not packs_shared_prompts(model):
        return False
    hidden = getattr(cfg, "hidden_size", None)
    layers = getattr(cfg, "num_hidden_layers", None)
    if not hidden or not layers:
        return False
    lengths = prompt_mask.sum(-1).long().index_add(0, rows, completion_mask.sum(-1).long())
    attention = 4 * float((lengths.double() ** 2).sum()) * hidden * layers
    n_params = sum(p.numel() for p in model.parameters())
    return attention <= 2 * n_params * TWO_CALL_OVERHEAD_TOKENS


def _packed_hidden(model, prompt_ids, prompt_mask, completion_ids, target, rows):
    """Hidden states predicting each completion token ``(N, H)`` (N = ``target.sum()``, in
    row-major order of ``target``) from one call over rows ``[prompt, completion, ...]``."""
    dev = prompt_ids.device
    B, Lp = prompt_ids.shape
    p_len = prompt_mask.sum(-1).long()  # (B,)
    c_len = target.sum(-1).long()  # (R,)
    # start of each completion in its packed row: after the prompt and the earlier completions
    order = torch.argsort(rows, stable=True)
    sorted_len = c_len[order]
    first_of_prompt = torch.zeros(B + 1, dtype=torch.long, device=dev)
    first_of_prompt.index_add_(0, rows + 1, torch.ones_like(rows))
    first_of_prompt = first_of_prompt.cumsum(0)  # (B+1,) first sorted completion of each prompt
    csum = torch.cat([sorted_len.new_zeros(1), sorted_len.cumsum(0)])  # (R+1,)
    start_sorted = p_len[rows[order]] + csum[:-1] - csum[first_of_prompt[rows[order]]]
    start = torch.empty_like(start_sorted).scatter_(0, order, start_sorted)  # (R,)
    row_len = p_len.clone().index_add_(0, rows, c_len)
    L = int(row_len.max())
    ids = prompt_ids.new_zeros(B, L)
    pos = torch.zeros(B, L, dtype=torch.long, device=dev)
    seg = torch.full((B, L), -1, dtype=torch.long, device=dev)  # 0 prompt, r+1 completion r
    # prompts: left-padded column j holds token j - (Lp - p_len) of the packed row
    pb, pj = prompt_mask.bool().nonzero(as_tuple=True)
    pcol = pj - (Lp - p_len[pb])
    ids[pb, pcol] = prompt_ids[pb, pj]
    pos[pb, pcol] = pcol
    seg[pb, pcol] = 0
    # completions
    cr, ct = target.nonzero(as_tuple=True)  # row-major, the order of the result
    cb = rows[cr]
    ccol = start[cr] + ct
    ids[cb, ccol] = completion_ids[cr, ct]
    pos[cb, ccol] = p_len[cb] + ct
    seg[cb, ccol] = cr + 1
    # key k is visible from query q if k <= q and k is in the prompt (seen from a prompt or
    # completion token) or in q's own segment; padding sees padding, so no row is empty
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    visible = ((seg.unsqueeze(1) == seg.unsqueeze(2))
               | ((seg.unsqueeze(1) == 0) & (seg.unsqueeze(2) >= 0))) & causal  # (B, q, k)
    mask = visible.unsqueeze(1)  # (B, 1, L, L)
    dtype = model.get_input_embeddings().weight.dtype
    # the mask's form follows the implementation this call will run (set here for the
    # length, as the base model's pre-hook will set it again)
    if attention_for_keys(model, L) == "eager":
        mask = torch.zeros(mask.shape, dtype=dtype, device=dev).masked_fill_(
            ~mask, torch.finfo(dtype).min)
    hidden = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos,
                              use_cache=False).last_hidden_state  # (B, L, H)
    # token t of completion r is predicted at the slot before it: the prompt's last token
    # for t = 0, else the completion's own token t - 1
    src = torch.where(ct == 0, p_len[cb] - 1, ccol - 1)
    return hidden[cb, src]


def _two_call_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, rows,
                     replay=None):
    """Hidden states predicting each completion position ``(R, Lc, H)``: the prompts run
    once into a KV cache, which is repeated to each completion for a second call (its
    linear layers and MLPs replayed from ``replay`` when given)."""
    positions = (prompt_mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    kw = cache_kwarg(model.base_model)
    h_prompt = model.base_model(input_ids=prompt_ids, attention_mask=prompt_mask,
                                position_ids=positions, use_cache=True,
                                **{kw: cache}).last_hidden_state[:, -1]  # (B, H)
    cache.batch_select_indices(rows)
    Lc = completion_ids.shape[1]
    c_positions = positions[rows, -1:] + 1 + torch.arange(Lc, device=positions.device)
    with replay_forward(replay):
        h_comp = model.base_model(
            input_ids=completion_ids,
            attention_mask=torch.cat([prompt_mask[rows], completion_mask], 1),
            position_ids=c_positions, use_cache=True, **{kw: cache}).last_hidden_state
    # h_comp: (kB, Lc, H)
    # token t of a completion is predicted from the hidden state before it
    return torch.cat([h_prompt[rows].unsqueeze(1), h_comp[:, :-1]], dim=1)


def value_head(model: PreTrainedModel) -> torch.nn.Module:
    """The scalar head of a reward or critic model (``*ForSequenceClassification.score``)."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise ValueError(f"{type(model).__name__} has no scalar `score` head to use as a critic")
    return head


def sequence_scores(model: PreTrainedModel, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar score of each sequence, read at its last non-padding token, ``(B,)``.

    The position comes from ``attention_mask`` (not from the pad id, which may equal eos), so
    left and right padding both work.
    """
    head = getattr(model, "score", None)
    T = attention_mask.shape[1]
    positions = torch.arange(T, device=attention_mask.device)
    last = torch.where(attention_mask.bool(), positions, -1).amax(dim=1)  # (B,)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    if isinstance(head, torch.nn.Module):
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).last_hidden_state
        return head(hidden[rows, last]).squeeze(-1).float()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return logits.squeeze(-1).float() if logits.dim() == 2 else logits[rows, last, 0].float()


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
               ) -> None:
    """Save as a Hugging Face directory (safetensors weights, config, tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
