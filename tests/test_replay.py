"""Reusing the sampler's forward in the update (``replay_projections``,
``reuse_sampler_head``): the linear-layer outputs the lean decoder saved give the same
log-probs and gradients as recomputing them,
for the whole batch (a view of the saved outputs) and for a shuffled subset (a copy), and
the trainer stops using them once the policy has taken an optimizer step."""

import json

import pytest
import torch

from bounds import (
    assert_within,
    grad_term_scales_by_row,
    logprob_scale,
    model_inner,
    model_stages,
    pair_bound,
    rel_bound,
)
from posttrain.fast.eligibility import can_replay
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.rollout import SamplingParams, generate
from posttrain.trainers.online import RLConfig, RLTrainer, TokenBatch
from rl_steps import rl_step

PROMPTS = ["1+2=", "17+25=", "3+4=", "100+200="]


def _model(tiny_model_dir, arch):
    """A random model whose eos logit is scaled up, so rows finish at many different steps
    and the sampler's cache is compacted several times (rows move slots)."""
    tok = load_tokenizer(tiny_model_dir)
    if arch == "builtin_tiny":
        model = load_causal_lm(tiny_model_dir, device="cpu")
    else:  # grouped-query attention and q/k/v biases: the other paths of the fused layout
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id, use_sliding_window=False))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 20
    return model.train(), tok


def _grads(model, tokens, rows, weights, replay):
    model.zero_grad()
    lp = tokens.logprobs(model, rows, reuse=replay)
    (lp * weights).sum().backward()
    return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def _term_scale(model, r, rows, weights):
    """The size of the terms each gradient element of ``(lp · weights).sum()`` adds up (one
    per token, bounds.grad_term_scales), flat like ``_grads``'s gradient. The terms are the
    same per-token log-probs from a plain forward of each sample alone (their size is the
    formula's, not the path's), so that a token's backward runs through its own sample only
    and a sample's tokens through one vectorised backward (bounds.grad_term_scales_by_row):
    the same sums as one backward per token of the whole batch, ~10x cheaper."""
    params = [p for p in model.parameters() if p.requires_grad]
    terms = []
    for i, row in enumerate(rows.tolist()):
        prompt, n = r.prompt_ids[row], int(r.lengths[row])
        completion = r.completion_ids[row, :n]
        assert (weights[i, n:] == 0).all()
        logits = model(input_ids=torch.tensor(prompt + completion.tolist())[None]).logits
        lp = logits[0, len(prompt) - 1:-1].log_softmax(-1).gather(-1, completion[:, None])
        w = weights[i, :n]
        terms.append((lp[:, 0] * w)[w != 0])
    scales = grad_term_scales_by_row(terms, params)
    return torch.cat([torch.full((p.numel(),), v, dtype=torch.float64)
                      for p, v in zip(params, scales, strict=True)])


def _sampled_lp_scale(model, r) -> float:
    """The size of a log-prob's terms (bounds.logprob_scale) over the samples' logits."""
    with torch.no_grad():
        return max(logprob_scale(model(input_ids=torch.tensor([p + c[:n].tolist()])).logits)
                   for p, c, n in zip(r.prompt_ids, r.completion_ids, r.lengths.tolist(),
                                      strict=True))


def _bounds(model, tokens: int):
    """The log-probs (a forward and the log-softmax) and gradients (and a backward) of the
    sampler's incremental forward, a replay and a recomputation are float32 computations of
    the same quantities, reductions no longer than V, the widths or the rows' tokens."""
    cfg = model.config
    return (pair_bound(model_stages(cfg, False) + 1, model_inner(cfg, tokens)),
            rel_bound(model_stages(cfg) + 1, model_inner(cfg, tokens)))


@pytest.mark.parametrize("fused", [False, True], ids=["head", "fused-head"])
@pytest.mark.parametrize("arch", ["builtin_tiny", "qwen2_gqa_bias"])
def test_replayed_logprobs_and_gradients_equal_recomputed(tiny_model_dir, arch, fused,
                                                          monkeypatch):
    """Also with the fused head (as at a large vocabulary), which then takes the sampler's
    log-sum-exp and entropy instead of its own forward matmul."""
    model, tok = _model(tiny_model_dir, arch)
    assert can_replay(model)
    # the sampler's buffers start as NaN: entries no step writes must come out as zeros
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *a, **kw: new_empty(self, *a, **kw).fill_(float("nan")))
    r = generate(model, tok, PROMPTS, n=8, params=SamplingParams(temperature=1.0,
                                                                 max_new_tokens=12),
                 generator=torch.Generator().manual_seed(0), engine="lean",
                 extras=frozenset({"projections", "head_stats"}))
    monkeypatch.undo()
    if fused:
        from posttrain.models import logprobs as model_logprobs

        monkeypatch.setattr(model_logprobs, "FUSED_HEAD_MIN_ELEMENTS", {"cpu": 0})
    assert len(set(r.lengths.tolist())) >= 4 and r.cache.activations is not None
    # the sampler's log-sum-exp and entropy are those of the model's own logits
    lse, ent = r.cache.head
    lp_scale = _sampled_lp_scale(model, r)  # also the size of the lse's and entropy's terms
    n_tokens = len(r.prompt_ids) * (max(map(len, r.prompt_ids)) + r.completion_ids.shape[1])
    lp_bound, grad_bound = _bounds(model, n_tokens)
    with torch.no_grad():
        ids = [torch.tensor(p + c[:n].tolist()) for p, c, n in
               zip(r.prompt_ids, r.completion_ids, r.lengths.tolist(), strict=True)]
        for i in (0, 5, 17):
            lp = len(r.prompt_ids[i])
            logits = model(input_ids=ids[i][None]).logits[0, lp - 1:-1]  # (n, V)
            n = len(logits)
            assert_within(lse[i, :n], logits.logsumexp(-1), lp_bound, lp_scale, "lse")
            want = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)  # Σ p·|log p| terms
            assert_within(ent[i, :n], want, lp_bound + pair_bound(1, logits.shape[-1]),
                          lp_scale, "entropy")
            assert (lse[i, n:] == 0).all() and (ent[i, n:] == 0).all()
    # a sample's last token and its padding were never fed: zero there (the values written
    # elsewhere are checked below, through the log-probs and gradients they give)
    unfed = torch.arange(r.completion_ids.shape[1])[None] >= r.lengths[:, None] - 1
    for saved in r.cache.activations.layers:
        for v in saved.values():
            assert v.shape[:2] == unfed.shape and torch.isfinite(v).all()
            assert (v[unfed] == 0).all()
    tokens = TokenBatch(r, tok.pad_token_id, "cpu", share_prompt=True)
    tokens.packed = False  # the two-call layout: a packed call replays nothing
    mask = tokens.completion_mask.bool()
    g = torch.Generator().manual_seed(1)
    for rows in (torch.arange(len(tokens)), torch.randperm(len(tokens), generator=g)[:11]):
        weights = torch.randn(len(rows), mask.shape[1], generator=g) * mask[rows]
        lp_replay, g_replay = _grads(model, tokens, rows, weights, replay=True)
        lp_full, g_full = _grads(model, tokens, rows, weights, replay=False)
        scale = _term_scale(model, r, rows, weights)
        # the float64 reference packed: the two-call layout's prompt call has fully masked
        # rows at left padding, which the model's eager attention turns into NaN in float64
        # (its softmax runs in float32, where the float64 mask value is -inf)
        tokens.packed = True
        _, g_exact = _grads(model.double(), tokens, rows, weights.double(), replay=False)
        tokens.packed = False
        model.float()
        assert g_full.abs().max() > 0
        assert_within(lp_replay, lp_full, lp_bound, lp_scale, "log-probs")
        # each within the float32 bound of the float64 gradient, element by element at the
        # size of the per-token terms (rounding differs between the sampler's incremental
        # forward and the full one, so not to the bit); a 1% error is ~50x beyond it
        assert_within(g_replay, g_exact, grad_bound, scale, "replayed gradient")
        assert_within(g_full, g_exact, grad_bound, scale, "recomputed gradient")
        # and both are the log-probs the sampler drew the tokens with (temperature 1)
        assert_within(lp_replay, r.logprobs[rows], lp_bound, lp_scale, "sampled log-probs")

    # the check can fail: the saved outputs of two samples swapped give other log-probs
    rows = torch.arange(len(tokens))
    for saved in tokens.cache.activations.layers:
        for v in saved.values():
            v[[0, 1]] = v[[1, 0]]
    with torch.no_grad():
        swapped = tokens.logprobs(model, rows, reuse=True)
        full = tokens.logprobs(model, rows, reuse=False)
    assert (swapped - full).abs().max() > 1e-2


def _adapted(model, rank: int = 4, dropout: float = 0.0, targets: str = "all-linear"):
    """``model`` with LoRA adapters on every projection, B random (a fresh B = 0 would
    leave the adapters' input gradients untested)."""
    pytest.importorskip("peft")
    from posttrain.models import lora

    torch.manual_seed(1)
    adapted = lora.add(model, RLConfig(lora_rank=rank, lora_dropout=dropout,
                                       lora_targets=targets))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return adapted


def _adapter_grads(model, tokens, rows, weights, replay):
    model.zero_grad()
    lp = tokens.logprobs(model, rows, reuse=replay)
    (lp * weights).sum().backward()
    return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()
                                   if p.requires_grad])


@pytest.mark.parametrize(("arch", "targets"), [
    ("builtin_tiny", "all-linear"), ("qwen2_gqa_bias", "all-linear"),
    # an MLP partly adapted: its projections replayed one by one
    ("builtin_tiny", "q_proj,v_proj,gate_proj")])
def test_lora_replay_gives_the_adapters_gradients(tiny_model_dir, arch, targets):
    """A LoRA policy sampled by the lean decoder (which merges ``W + s·B·A`` per call): the
    sampler's log-probs are the policy's, the update's forward takes the merged layers'
    outputs, and the adapters' gradients are within the float32 bound of the float64
    gradient (a forward and backward, plus the merge's one rounding of each weight), as
    recomputing through peft is."""

    base, tok = _model(tiny_model_dir, arch)
    model = _adapted(base, targets=targets)
    assert can_replay(model)
    r = generate(model, tok, PROMPTS, n=8, params=SamplingParams(temperature=1.0,
                                                                   max_new_tokens=12),
                 generator=torch.Generator().manual_seed(0), engine="lean",
                 extras=frozenset({"projections"}))
    lp_scale = _sampled_lp_scale(model, r)
    n_tokens = len(r.prompt_ids) * (max(map(len, r.prompt_ids)) + r.completion_ids.shape[1])
    lp_bound = _bounds(model, n_tokens)[0]  # (the merge rounds each weight once more: + 1)
    lp_bound += pair_bound(1, base.config.hidden_size)
    tokens = TokenBatch(r, tok.pad_token_id, "cpu", share_prompt=True)
    tokens.packed = False
    mask = tokens.completion_mask.bool()
    g = torch.Generator().manual_seed(1)
    for rows in (torch.arange(len(tokens)), torch.randperm(len(tokens), generator=g)[:11]):
        weights = torch.randn(len(rows), mask.shape[1], generator=g) * mask[rows]
        lp_replay, g_replay = _adapter_grads(model, tokens, rows, weights, replay=True)
        lp_full, g_full = _adapter_grads(model, tokens, rows, weights, replay=False)
        tokens.packed = True  # (float64: see the test above)
        _, g_exact = _adapter_grads(model.double(), tokens, rows, weights.double(),
                                    replay=False)
        tokens.packed = False
        model.float()
        assert g_full.abs().max() > 0
        assert_within(lp_replay, lp_full, lp_bound, lp_scale, "log-probs")
        bound = rel_bound(model_stages(base.config) + 1, model_inner(base.config,
                                                                     mask.shape[1] + 8))
        for got in (g_replay, g_full):
            assert float((got.double() - g_exact).norm() / g_exact.norm()) <= bound
        assert_within(lp_replay, r.logprobs[rows], lp_bound, lp_scale, "sampled log-probs")


def test_not_replayed_where_the_forward_differs(tiny_model_dir):
    """Dropout, gradient checkpointing or a wrapped projection turn replay off."""
    model, _ = _model(tiny_model_dir, "builtin_tiny")
    model.model.layers[0].mlp.down_proj = torch.nn.Sequential(model.model.layers[0].mlp.down_proj)
    assert not can_replay(model)
    model, _ = _model(tiny_model_dir, "builtin_tiny")
    model.config.attention_dropout = 0.1
    assert not can_replay(model)
    model, _ = _model(tiny_model_dir, "builtin_tiny")
    enable = (getattr(model, "activation_checkpointing_enable", None)  # transformers ≥ 5.x
              or model.gradient_checkpointing_enable)
    enable()
    assert not can_replay(model)


def _task_files(tmp_path):
    """A reward file (``by_len``, and ``odd_len``: zero for half the prompts) and 8 prompts."""
    reward = tmp_path / "r.py"
    reward.write_text("def by_len(prompts, completions, **_):\n"
                      "    return [float(len(c)) for c in completions]\n"
                      "def odd_len(prompts, completions, **_):\n"
                      "    return [float(len(c) * (int(p[0]) % 2)) for p, c in\n"
                      "            zip(prompts, completions)]\n")
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(8)))
    return reward, data


def _rl_trainer(tiny_model_dir, out, reward, data, reuse, fn="by_len", **kw):
    cfg = RLConfig(model=tiny_model_dir, output_dir=str(out), max_steps=1, prompts_per_step=2,
                   group_size=4, max_new_tokens=6, builtin_eval_size=0, eval_every=0,
                   device="cpu", tensorboard=False, temperature=1.5, share_prompt=True,
                   data=str(data), reward=f"{reward}:{fn}", lr=1.0,
                   replay_projections=reuse,
                   reuse_sampler_head=reuse, **kw)
    cfg.validate()
    return RLTrainer(cfg)


@pytest.mark.parametrize("kw", [
    dict(algo="grpo", kl_coef=0.04, ppo_epochs=2, minibatch_size=4, micro_batch_size=2),
    # half the prompts carry no signal: several sampling rounds, select and concat
    dict(algo="dapo", dynamic_sampling_rounds=8, minibatch_size=8, micro_batch_size=8,
         fn="odd_len"),
    dict(algo="grpo", kl_coef=0.04, minibatch_size=8, micro_batch_size=8),
    # LoRA: the lean decoder samples the adapted policy, the reference is the adapter off
    dict(algo="grpo", kl_coef=0.04, minibatch_size=8, micro_batch_size=4, lora_rank=4),
])
@pytest.mark.parametrize("layout", ["two-call", "fused-head", "fused-head-packed"])
def test_trainer_step_same_with_and_without_reuse(tiny_model_dir, tmp_path, kw, layout,
                                                  monkeypatch):
    """A whole step (sampling, old log-probs, several minibatches and epochs at a large
    learning rate, dynamic sampling's select and concat) moves the policy the same way with
    the sampler's outputs reused as without; after the first optimizer step the policy has
    moved, and outputs used past it would show as a different update. With the fused head
    (as at a large vocabulary) the sampler's head statistics stand in for its forward, in
    the two-call layout and in a packed one (which replays no projection)."""
    from posttrain.fast.replay import DecodeActivations
    from posttrain.models import logprobs as model_logprobs
    from posttrain.trainers.online import batch

    # rows this short would be packed into one call, which replays nothing: take two calls
    packed = layout.endswith("packed")
    monkeypatch.setattr(batch, "packing_pays", lambda *a, **k: packed)
    sampled = []
    if layout.startswith("fused"):
        monkeypatch.setattr(model_logprobs, "FUSED_HEAD_MIN_ELEMENTS", {"cpu": 0})
        fused = model_logprobs.head_token_logprobs
        monkeypatch.setattr(model_logprobs, "head_token_logprobs", lambda *a, **k: (
            sampled.append(k.get("known") is not None) or fused(*a, **k)))
    replays = []
    replay_map = DecodeActivations.replay_map
    monkeypatch.setattr(DecodeActivations, "replay_map",
                        lambda self, *a: replays.append(1) or replay_map(self, *a))
    reward, data = _task_files(tmp_path)
    moved = []
    for reuse in (True, False):
        torch.manual_seed(0)
        trainer = _rl_trainer(tiny_model_dir, tmp_path / str(reuse), reward, data, reuse, **kw)
        assert trainer.reuse.projections is reuse
        before = [p.detach().clone() for p in trainer.policy.parameters()]
        # plain SGD: the update is proportional to the gradient (Adam's first steps are
        # about its sign, which float rounding can flip where a gradient is ~0)
        record = rl_step(trainer, torch.optim.SGD(trainer.policy.parameters(), lr=1.0))
        assert record["optim/steps"] >= 1
        assert record["sampling/rounds"] > 1 or kw["algo"] != "dapo"
        moved.append(torch.cat([(p.detach() - b).flatten()
                                for p, b in zip(trainer.policy.parameters(), before, strict=True)]))
        assert (len(replays) > 0) is (reuse and not packed)
        assert any(sampled) is (reuse and layout.startswith("fused"))
        replays.clear(), sampled.clear()
    assert moved[1].abs().max() > 1e-3  # the step moved the policy, far above rounding
    torch.testing.assert_close(moved[0], moved[1], rtol=0, atol=1e-5 * moved[1].abs().max())


def test_head_statistics_only_where_the_update_computes_what_sampling_did(tiny_model_dir,
                                                                            tmp_path,
                                                                            monkeypatch):
    """The sampler's head statistics stand in for the head only when the head fuses and the
    update's forward drops nothing (LoRA's dropout would make ``z_y − lse`` a mismatch)."""
    pytest.importorskip("peft")
    from posttrain.models import logprobs as model_logprobs

    reward, data = _task_files(tmp_path)
    assert not _rl_trainer(tiny_model_dir, tmp_path / "small", reward, data,
                           True).reuse.head  # this head never fuses
    monkeypatch.setattr(model_logprobs, "FUSED_HEAD_MIN_ELEMENTS", {"cpu": 0})
    assert _rl_trainer(tiny_model_dir, tmp_path / "a", reward, data, True).reuse.head
    assert not _rl_trainer(tiny_model_dir, tmp_path / "b", reward, data, True, lora_rank=4,
                           lora_dropout=0.1).reuse.head
    assert not _rl_trainer(tiny_model_dir, tmp_path / "c", reward, data,
                           False).reuse.head


def test_packed_batches_replay_nothing_and_stop_the_capture(tiny_model_dir, tmp_path,
                                                            monkeypatch):
    """Where the shared-prompt passes are packed into one call (short rows), nothing is
    replayed, the saved outputs are dropped, and the next rollouts are not captured; the
    step is the one without reuse."""
    from posttrain.fast.replay import DecodeActivations
    from posttrain.rollout.lean import LeanEngine

    reward, data = _task_files(tmp_path)
    monkeypatch.setattr(DecodeActivations, "replay_map",
                        lambda *a: pytest.fail("a packed batch replayed the sampler's outputs"))
    captures = []
    generate_ = LeanEngine.generate
    monkeypatch.setattr(LeanEngine, "generate",
                        lambda *a, extras, **k: captures.append("projections" in extras) or
                        generate_(*a, extras=extras, **k))
    moved = []
    for reuse in (True, False):
        torch.manual_seed(0)
        trainer = _rl_trainer(tiny_model_dir, tmp_path / str(reuse), reward, data, reuse,
                              kl_coef=0.04)
        opt = torch.optim.SGD(trainer.policy.parameters(), lr=1.0)
        before = [p.detach().clone() for p in trainer.policy.parameters()]
        rl_step(trainer, opt)
        assert trainer.packed
        moved.append(torch.cat([(p.detach() - b).flatten()
                                for p, b in zip(trainer.policy.parameters(), before, strict=True)]))
        rl_step(trainer, opt)
    # the first rollout with reuse was captured (packing is decided on the batch), the
    # second was not
    assert captures == [True, False, False, False]
    torch.testing.assert_close(moved[0], moved[1], rtol=0, atol=1e-5 * moved[1].abs().max())


def _mlp_and_linear_grads(mlp, lin, x, gy, gz, replay):
    from posttrain.fast.replay import replay_forward

    params = (*mlp.parameters(), *lin.parameters())
    for p in params:
        p.grad = None
    x.grad = None
    with torch.no_grad():
        saved = {mlp: (mlp.gate_proj(x), mlp.up_proj(x), mlp(x)), lin: lin(x)}
    with replay_forward(saved if replay else None):
        y, z = mlp(x), lin(x)
    ((y * gy).sum() + (z * gz).sum()).backward()
    return [y.detach(), z.detach(), x.grad] + [p.grad for p in params]


def test_replayed_modules_have_the_modules_gradients_in_float64():
    """``replay_forward`` on a Llama MLP and a biased linear layer, given the outputs the
    modules compute: the same outputs and the same gradients (input and every weight) as
    autograd through the modules, in float64, for inputs up to |x| = 30."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=12, num_attention_heads=2,
                               num_key_value_heads=2)).double()
    lin = torch.nn.Linear(8, 5).double()
    for scale in (1.0, 30.0):
        x = (torch.randn(3, 4, 8, dtype=torch.float64) * scale).requires_grad_()
        gy = torch.randn(3, 4, 8, dtype=torch.float64)
        gz = torch.randn(3, 4, 5, dtype=torch.float64)
        replayed = _mlp_and_linear_grads(mlp, lin, x, gy, gz, replay=True)
        autograd = _mlp_and_linear_grads(mlp, lin, x, gy, gz, replay=False)
        for a, b in zip(replayed, autograd, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * scale)


def test_replay_refuses_a_mismatched_or_repeated_call():
    from posttrain.fast.replay import replay_forward

    lin = torch.nn.Linear(4, 3)
    with pytest.raises(RuntimeError, match="got input"), replay_forward({lin: torch.zeros(2, 3)}):
        lin(torch.zeros(5, 4))
    with pytest.raises(RuntimeError, match="ran twice"), replay_forward({lin: torch.zeros(2, 3)}):
        lin(torch.zeros(2, 4))
        lin(torch.zeros(2, 4))
    assert "forward" not in vars(lin)  # the module is itself again
    assert lin(torch.zeros(5, 4)).shape == (5, 3)


def test_replay_refuses_activations_once_the_policy_has_stepped(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """The loop reordered: an optimiser step between sampling and the pass that would replay.
    The saved activations carry the policy version they were captured at, and the pass
    refuses them instead of computing a gradient for weights that no longer exist."""
    from posttrain.fast.cache import StaleCache, policy_version
    from posttrain.trainers.online import batch

    monkeypatch.setattr(batch, "packing_pays", lambda *a, **k: False)
    reward, data = _task_files(tmp_path)
    trainer = _rl_trainer(tiny_model_dir, tmp_path / "run", reward, data, True)
    exp = trainer.experience.collect(1)
    tokens = TokenBatch(exp.rollout, trainer.tok.pad_token_id, "cpu", share_prompt=True)
    assert tokens.cache.activations is not None
    rows = torch.arange(len(tokens))
    with torch.no_grad():  # the policy unchanged: replay is taken
        tokens.logprobs(trainer.policy, rows, reuse=True)
    v0 = policy_version(trainer.policy)
    lp = tokens.logprobs(trainer.policy, rows)  # recomputed: fine at any version
    (-lp.sum()).backward()
    trainer.optimizers[0].step()
    assert policy_version(trainer.policy) == v0 + 1
    with pytest.raises(StaleCache, match="changed since sampling"):
        tokens.logprobs(trainer.policy, rows, reuse=True)


def test_lora_replay_runs_on_a_bfloat16_base(tiny_model_dir):
    """A bfloat16 base with peft's float32 adapters: the lean decoder merges in the
    adapters' dtype and casts, and the replay's adapter products run in float32. Replayed
    and recomputed gradients agree to bfloat16 rounding (relative 2^-8 per op, a few dozen
    ops deep); a dtype slip would raise, a wrong term would miss by O(1)."""
    base, tok = _model(tiny_model_dir, "builtin_tiny")
    model = _adapted(base.to(torch.bfloat16))
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    r = generate(model, tok, PROMPTS, n=4, params=SamplingParams(temperature=1.0,
                                                                   max_new_tokens=8),
                 generator=torch.Generator().manual_seed(0), engine="lean",
                 extras=frozenset({"projections"}))
    assert r.cache.activations is not None
    tokens = TokenBatch(r, tok.pad_token_id, "cpu", share_prompt=True)
    tokens.packed = False
    mask = tokens.completion_mask.bool()
    rows = torch.arange(len(tokens))
    weights = (torch.randn(len(rows), mask.shape[1], generator=torch.Generator().manual_seed(1))
               * mask).to(torch.bfloat16)
    _, g_replay = _adapter_grads(model, tokens, rows, weights, replay=True)
    _, g_full = _adapter_grads(model, tokens, rows, weights, replay=False)
    assert torch.isfinite(g_replay).all() and g_full.abs().max() > 0
    assert float((g_replay - g_full).norm() / g_full.norm()) < 0.1
