"""Model families beyond Llama, on tiny random configs built here (no download): every pass a
trainer runs — the update, old and reference log-probs (shared-prompt layout, packed or in
two calls, and full sequences), DPO pairs, the critic's values — equals a plain forward of
each whole sequence on its own, to float32 rounding; and a few GRPO steps run.

Each family brings its own special case: a sliding window shorter than the rows (Mistral,
Gemma-2/3: a packed custom mask would let tokens see past it), a soft-capped head (Gemma-2/3),
routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE), and Qwen2's q/k/v biases.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from bounds import model_inner, model_stages, rel_bound
from posttrain.builtin.tokenizer import build_tokenizer
from posttrain.data import pad_sequences, pad_shared_prompts
from posttrain.fast.compile import compile_pointwise_blocks
from posttrain.models import (
    active_parameters,
    completion_logprobs,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    packing_pays,
    shared_prompt_logprobs,
)
from posttrain.rollout import make_engine, requests_for

COMMON = dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
WINDOW = 6  # shorter than the rows below, so a window that is ignored shows
FAMILIES = {
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, {}),
    "mistral": (MistralConfig, dict(sliding_window=WINDOW)),
    "gemma2": (Gemma2Config, dict(sliding_window=WINDOW, final_logit_softcapping=5.0,
                                  attn_logit_softcapping=20.0, query_pre_attn_scalar=8)),
    "gemma3": (Gemma3TextConfig, dict(sliding_window=WINDOW, final_logit_softcapping=5.0,
                                      query_pre_attn_scalar=8, sliding_window_pattern=2)),
    "mixtral": (MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (Qwen2MoeConfig, dict(num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32,
                                       shared_expert_intermediate_size=32)),
    "qwen3_moe": (Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_topk_prob=True)),
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
COMPLETIONS = [[20, 21, 22, 23, 24, 25], [26, 27], [30, 31, 32, 33], [34, 35, 36, 37, 38]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory) -> str:
    cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    cfg = cls(**{**COMMON, **extra})
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # random weights large enough that the soft cap matters
        model.get_output_embeddings().weight.mul_(40)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def plain_logprobs(model, prompts, completions) -> list[torch.Tensor]:
    """Each sequence alone, no padding, the model's own forward and log-softmax."""
    out = []
    for p, c in zip(prompts, completions, strict=True):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0, len(p) - 1:-1].double()
        out.append(logits.log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    a, b = torch.cat([g.double() for g in got]), torch.cat(want)
    return float((a - b).norm() / b.norm())


def test_every_pass_equals_a_plain_forward(family_dir):
    model = load_causal_lm(family_dir, device="cpu").eval()
    bound = 2 * rel_bound(model_stages(model.config, backward=False),
                          model_inner(model.config, 16))
    k = len(COMPLETIONS) // len(PROMPTS)
    want = plain_logprobs(model, PROMPTS * k, COMPLETIONS)
    shared = pad_shared_prompts(PROMPTS, COMPLETIONS, 0)
    full = pad_sequences(PROMPTS * k, COMPLETIONS, 0)
    lengths = [len(c) for c in COMPLETIONS]
    with torch.no_grad():
        got = {
            "full": completion_logprobs(model, full["input_ids"], full["attention_mask"],
                                        full["loss_mask"]),
            "two calls": shared_prompt_logprobs(model, shared["prompt_ids"],
                                                shared["prompt_mask"], shared["completion_ids"],
                                                shared["completion_mask"], packed=False),
            "auto": shared_prompt_logprobs(model, shared["prompt_ids"], shared["prompt_mask"],
                                           shared["completion_ids"], shared["completion_mask"]),
        }
    for name, lp in got.items():
        if name == "full":  # (B, T-1) layout: completion j of row i ends the row
            rows = [lp[i, full["loss_mask"][i, 1:].bool()] for i in range(len(lp))]
        else:
            rows = [lp[i, :n] for i, n in enumerate(lengths)]
        assert rel_err(rows, want) <= bound, (name, rel_err(rows, want), bound)
    window = getattr(model.config, "sliding_window", None)
    rows_len = max(len(p) for p in PROMPTS) + sum(lengths[::len(PROMPTS)])
    if window and rows_len > window:  # a packed mask would let tokens see past the window
        rows = torch.arange(len(PROMPTS)).repeat(k)
        assert not packing_pays(model, shared["prompt_mask"], shared["completion_mask"], rows)


def test_critic_values_and_reward_scores(family_dir):
    """The critic's per-token values equal its value head on each whole sequence's hidden
    states (the TokenBatch layouts the PPO passes use)."""
    from posttrain.rollout import Rollout
    from posttrain.trainers.online import TokenBatch

    tok = load_tokenizer(family_dir)
    torch.manual_seed(0)
    critic = load_reward_model(family_dir, tok, device="cpu").eval()
    k = len(COMPLETIONS) // len(PROMPTS)
    T = max(len(c) for c in COMPLETIONS)
    ids = torch.zeros(len(COMPLETIONS), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(COMPLETIONS):
        ids[i, :len(c)], mask[i, :len(c)] = torch.tensor(c), 1
    ro = Rollout(prompt_ids=PROMPTS * k, completion_ids=ids, completion_mask=mask,
                 logprobs=torch.zeros(ids.shape), truncated=torch.zeros(len(ids), dtype=bool),
                 group_ids=torch.arange(len(PROMPTS)).repeat(k), texts=[""] * len(ids))
    want = []
    with torch.no_grad():
        for p, c in zip(PROMPTS * k, COMPLETIONS, strict=True):
            h = critic.base_model(input_ids=torch.tensor([p + c])).last_hidden_state
            want.append(critic.score(h[0, len(p) - 1:-1]).squeeze(-1).double())
        bound = 2 * rel_bound(model_stages(critic.config, backward=False),
                              model_inner(critic.config, 16))
        for share in (True, False):
            tb = TokenBatch(ro, 0, "cpu", share)
            v = tb.values(critic, torch.arange(len(ids)))
            got = [v[i, :len(c)] for i, c in enumerate(COMPLETIONS)]
            assert rel_err(got, want) <= bound, (share, rel_err(got, want))


def test_sampling_engine_and_log_probs_agree(family_dir):
    """The engine the trainer would pick samples; its log-probs at temperature 1 equal the
    plain forward's (the first update's ratio is 1 up to rounding)."""
    from posttrain.rollout import SamplingParams

    model = load_causal_lm(family_dir, device="cpu").eval()
    tok = load_tokenizer(family_dir)
    engine = make_engine("auto", model, tok)
    ro = engine.generate(requests_for(tok, ["12+3=", "7+45="]), 2,
                         SamplingParams(max_new_tokens=6), torch.Generator().manual_seed(0))
    prompts = [tok(p)["input_ids"] for p in ("12+3=", "7+45=")]
    completions = [r[m.bool()].tolist() for r, m in zip(ro.completion_ids, ro.completion_mask,
                                                        strict=True)]
    want = plain_logprobs(model, [p for p in prompts for _ in range(2)], completions)
    got = [ro.logprobs[i, :len(c)] for i, c in enumerate(completions)]
    bound = 2 * rel_bound(model_stages(model.config, backward=False),
                          model_inner(model.config, 16))
    assert rel_err(got, want) <= bound


def test_a_few_grpo_steps_run(family_dir, tmp_path):
    from posttrain.trainers.online import RLConfig, run_rl

    cfg = RLConfig(model=family_dir, output_dir=str(tmp_path), max_steps=2, prompts_per_step=2,
                   group_size=2, max_new_tokens=4, builtin_train_size=8, builtin_eval_size=2,
                   log_every=1, device="cpu", tensorboard=False, kl_coef=0.04)
    cfg.validate()
    last = run_rl(cfg)
    assert "eval/accuracy" in last and (tmp_path / "final" / "model.safetensors").is_file()


def test_moe_costed_by_active_parameters_and_experts_not_compiled():
    torch.manual_seed(0)
    cls, extra = FAMILIES["mixtral"]
    moe = AutoModelForCausalLM.from_config(cls(**{**COMMON, **extra}))
    total = sum(p.numel() for p in moe.parameters())
    routed = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    assert routed > 0
    assert active_parameters(moe) == total - routed + routed * 2 // 4
    dense = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON))
    assert active_parameters(dense) == sum(p.numel() for p in dense.parameters())
    compile_pointwise_blocks(moe)
    compiled = [type(m).__name__ for m in moe.modules()
                if getattr(m, "_compiled_call_impl", None) is not None]
    assert compiled and all(name.endswith("RMSNorm") for name in compiled)


def test_backbone_through_a_peft_wrapper(tmp_path):
    """A peft-wrapped model's ``base_model`` is its LoraModel; ``backbone`` reaches the real
    decoder stack, so the log-probs of the wrapped model (adapter at zero) equal the base's."""
    peft = pytest.importorskip("peft")
    from posttrain.models import backbone

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON)).eval()
    want_backbone = base.model
    batch = pad_sequences(PROMPTS * 2, COMPLETIONS, 0)
    with torch.no_grad():
        want = completion_logprobs(base, batch["input_ids"], batch["attention_mask"],
                                   batch["loss_mask"])
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert wrapped.base_model is not want_backbone
    assert backbone(wrapped) is want_backbone
    with torch.no_grad():
        got = completion_logprobs(wrapped, batch["input_ids"], batch["attention_mask"],
                                  batch["loss_mask"])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_fused_head_equals_the_unfused_one(family_dir, monkeypatch):
    """Log-probs straight from hidden states (the head applied chunk by chunk, recomputed in
    the backward; with the soft cap where the family has one) against the full logits:
    values and every parameter's gradient within the float32 bound."""
    from posttrain.models import logprobs as lpmod

    model = load_causal_lm(family_dir, device="cpu").eval()
    k = len(COMPLETIONS) // len(PROMPTS)
    full = pad_sequences(PROMPTS * k, COMPLETIONS, 0)
    weights = torch.randn(full["input_ids"].shape[0], full["input_ids"].shape[1] - 1,
                          generator=torch.Generator().manual_seed(0))
    calls = []
    fused = lpmod.head_token_logprobs
    monkeypatch.setattr(lpmod, "head_token_logprobs",
                        lambda *a, **kw: calls.append(1) or fused(*a, chunk_rows=3, **kw))

    def run(threshold):
        monkeypatch.setattr(lpmod, "FUSED_HEAD_MIN_ELEMENTS", {"cpu": threshold})
        model.zero_grad(set_to_none=True)
        lp = completion_logprobs(model, full["input_ids"], full["attention_mask"],
                                 full["loss_mask"], temperature=0.7)
        (lp * weights).sum().backward()
        return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()
                                       if p.grad is not None])

    plain_lp, plain_grad = run(1 << 62)
    assert not calls
    fused_lp, fused_grad = run(0)
    assert calls  # the fused path ran
    bound = 2 * rel_bound(model_stages(model.config), model_inner(model.config, 16))
    assert rel_err([fused_lp.flatten()], [plain_lp.double().flatten()]) <= bound
    assert rel_err([fused_grad], [plain_grad.double()]) <= bound


def test_the_fused_head_with_tied_embeddings(monkeypatch):
    """The built-in model ties its head to the input embeddings: the fused head's weight
    gradient lands on the shared parameter, as the unfused head's does."""
    from posttrain.models import logprobs as lpmod

    model = load_causal_lm("builtin", device="cpu").eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    full = pad_sequences(PROMPTS * 2, COMPLETIONS, 0)

    def run(threshold):
        monkeypatch.setattr(lpmod, "FUSED_HEAD_MIN_ELEMENTS", {"cpu": threshold})
        model.zero_grad(set_to_none=True)
        completion_logprobs(model, full["input_ids"], full["attention_mask"],
                            full["loss_mask"]).sum().backward()
        return model.get_input_embeddings().weight.grad.clone()

    plain, fused = run(1 << 62), run(0)
    bound = 2 * rel_bound(model_stages(model.config), model_inner(model.config, 16))
    assert rel_err([fused.flatten()], [plain.double().flatten()]) <= bound
