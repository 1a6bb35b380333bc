"""Model loading, completion log-probabilities, sequence scores and saving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from bounds import (
    assert_within,
    grad_term_scales,
    logprob_scale,
    model_inner,
    model_stages,
    pair_bound,
    rel_bound,
)
from posttrain.data import pad_sequences
from posttrain.fast import prepare_model
from posttrain.models import (
    completion_logprobs,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    save_model,
    sequence_scores,
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, device="cpu").eval()


@pytest.fixture(scope="module")
def rm(tiny_model_dir, tok):
    torch.manual_seed(0)
    model = load_reward_model(tiny_model_dir, tok, device="cpu").eval()
    with torch.no_grad():  # a head large enough that scores differ visibly between inputs
        model.score.weight.normal_(0, 1.0)
    return model


def random_batch(seed: int, lengths: list[tuple[int, int]], vocab: int = 259):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p, _ in lengths]
    comps = [torch.randint(3, vocab, (c,), generator=g).tolist() for _, c in lengths]
    return prompts, comps, pad_sequences(prompts, comps, pad_id=0)


def lp_bound(model, ids, backward: bool = False) -> float:
    """Two float32 computations of per-token log-probs (another batch layout, another code
    path): the model's forward (and backward) plus the log-softmax over V, reductions no
    longer than V, the widths or the batch's tokens (a weight's gradient sums over all)."""
    return pair_bound(model_stages(model.config, backward) + 1,
                      model_inner(model.config, ids.numel()))


def lp_scale(model, ids, mask=None) -> float:
    """The size of a log-prob's terms (bounds.logprob_scale) on these inputs' logits."""
    with torch.no_grad():
        return logprob_scale(model(input_ids=ids, attention_mask=mask).logits)


def score_scale(rm, ids, mask) -> float:
    """The size of the terms of a score ``w·h`` at the last real token: ‖w‖·‖h‖ bounds
    Σ|w_i||h_i|, and an error in ``h`` (relative to ‖h‖) reaches the score through ‖w‖."""
    with torch.no_grad():
        h = rm.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return float(rm.score.weight.norm()) * float(h.norm(dim=-1).max())


def naive_logprobs(model, batch):
    """The full-logits path: log-softmax everywhere, gather the next token, mask."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return lp * batch["loss_mask"][:, 1:]


def test_load_tokenizer_pad(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_completion_logprobs_matches_naive(lm):
    _, _, batch = random_batch(0, [(3, 4), (5, 2), (1, 6)])  # right padding on rows 0 and 1
    with torch.no_grad():
        got = completion_logprobs(lm, **batch)
        want = naive_logprobs(lm, batch)
    assert got.shape == (3, batch["input_ids"].shape[1] - 1)
    ids = batch["input_ids"]  # the same log-probs through another path: lp_bound
    assert_within(got, want, lp_bound(lm, ids), lp_scale(lm, ids, batch["attention_mask"]))
    # zero exactly off the completion positions, non-zero on them
    target = batch["loss_mask"][:, 1:].bool()
    assert torch.all(got[~target] == 0)
    assert torch.all(got[target] < 0)


def test_completion_logprobs_gradient_matches_naive(lm):
    _, _, batch = random_batch(1, [(2, 3), (4, 2)])
    params = [p for p in lm.parameters()]
    g1 = torch.autograd.grad(completion_logprobs(lm, **batch).sum(), params)
    naive = naive_logprobs(lm, batch)
    scales = grad_term_scales(naive[batch["loss_mask"][:, 1:].bool()], params)  # per token
    g2 = torch.autograd.grad(naive.sum(), params)
    bound = lp_bound(lm, batch["input_ids"], backward=True)
    for (name, _), a, b, s in zip(lm.named_parameters(), g1, g2, scales, strict=True):
        assert_within(a, b, bound, s, name)


def test_completion_logprobs_independent_of_right_padding(lm):
    prompts, comps, batch = random_batch(2, [(3, 2), (6, 5)])
    with torch.no_grad():
        both = completion_logprobs(lm, **batch)
        alone = completion_logprobs(lm, **pad_sequences(prompts[:1], comps[:1], 0))
    assert_within(both[0, : alone.shape[1]], alone[0], lp_bound(lm, batch["input_ids"]),
                  lp_scale(lm, batch["input_ids"], batch["attention_mask"]))
    assert torch.all(both[0, alone.shape[1]:] == 0)


def test_completion_logprobs_non_plain_head_path(lm, monkeypatch):
    """A soft-capped head takes the full-logits branch; with no capping it agrees."""
    _, _, batch = random_batch(3, [(2, 3), (4, 2)])
    with torch.no_grad():
        fast = completion_logprobs(lm, **batch)
        monkeypatch.setattr("posttrain.models.logprobs.has_plain_head", lambda model: False)
        slow = completion_logprobs(lm, **batch)
    assert_within(fast, slow, lp_bound(lm, batch["input_ids"]),
                  lp_scale(lm, batch["input_ids"], batch["attention_mask"]))


def test_sequence_scores_reads_last_real_token(rm):
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (3, 5, 2)]
    with torch.no_grad():
        alone = torch.stack([sequence_scores(rm, torch.tensor([s]), torch.ones(1, len(s),
                                                                             dtype=torch.long))[0]
                             for s in seqs])
        # the head applied by hand to the last hidden state of each unpadded sequence
        by_hand = torch.stack([rm.score(rm.model(input_ids=torch.tensor([s])).last_hidden_state
                                        [0, -1]).squeeze() for s in seqs])
        T = 5
        right = torch.zeros(3, T, dtype=torch.long)
        right_mask = torch.zeros(3, T, dtype=torch.long)
        left = torch.zeros(3, T, dtype=torch.long)
        left_mask = torch.zeros(3, T, dtype=torch.long)
        for i, s in enumerate(seqs):
            right[i, : len(s)] = torch.tensor(s)
            right_mask[i, : len(s)] = 1
            left[i, T - len(s):] = torch.tensor(s)
            left_mask[i, T - len(s):] = 1
        r = sequence_scores(rm, right, right_mask)
        lft = sequence_scores(rm, left, left_mask)
    assert len(set(alone.tolist())) == 3  # the scores tell the sequences apart
    # the same scores through other layouts: two forwards of the backbone and the head
    bound = pair_bound(model_stages(rm.config, False), model_inner(rm.config, right.numel()))
    scale = score_scale(rm, right, right_mask)
    assert_within(alone, by_hand, bound, scale)
    assert_within(r, alone, bound, scale)
    assert_within(lft, alone, bound, scale)


def test_sequence_scores_padding_amount_does_not_matter(rm):
    s = [10, 20, 30, 40]
    scores = []
    with torch.no_grad():
        for extra in (0, 1, 4):
            ids = torch.tensor([s + [2] * extra])  # pad with eos: the mask, not the id, decides
            mask = torch.tensor([[1] * len(s) + [0] * extra])
            scores.append(float(sequence_scores(rm, ids, mask)[0]))
    bound = pair_bound(model_stages(rm.config, False), model_inner(rm.config, len(s) + 4))
    scale = score_scale(rm, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))
    assert abs(scores[1] - scores[0]) <= bound * scale
    assert abs(scores[2] - scores[0]) <= bound * scale


def test_save_model_reloads_with_plain_transformers(lm, tok, tmp_path):
    save_model(lm, tok, tmp_path / "out")
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in files
    assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files)
    assert "eager" not in (tmp_path / "out" / "config.json").read_text()  # a runtime choice
    # ``lm`` is loaded as plain transformers would (sdpa), so the bit-exact comparison
    # reloads with the same implementation
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                  attn_implementation="sdpa").eval()
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "out")
    _, _, batch = random_batch(5, [(3, 4), (2, 2)])
    with torch.no_grad():
        a = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        b = model2(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(a, b)
    text = "12+34=46"
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    assert (tok2.pad_token_id, tok2.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


def test_fresh_reward_head_starts_at_unit_scale(tiny_model_dir, tok, tmp_path):
    """Given a batch, a fresh head is drawn so that its scores of that batch have standard
    deviation 1 (to the forward's float rounding), where transformers' N(0, 0.02²) head
    scores within |w|·max|h| < 1 of zero (a standard deviation below 1): under AdamW the
    score moves in proportion to |w|, and that small a head left the built-in recipe at
    ln 2 for hundreds of steps (docs/benchmarks.md). A checkpoint's own head is kept as saved."""
    _, _, batch = random_batch(7, [(3, 4), (2, 2), (5, 1), (4, 3), (1, 5), (2, 3)])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    torch.manual_seed(0)
    rm = load_reward_model(tiny_model_dir, tok, device="cpu", head_batch=(ids, mask))
    with torch.no_grad():
        std = float(sequence_scores(rm.eval(), ids, mask).std())
    cfg = rm.config
    assert abs(std - 1) <= pair_bound(model_stages(cfg, backward=False),
                                      model_inner(cfg, ids.shape[1]))

    torch.manual_seed(0)
    plain = load_reward_model(tiny_model_dir, tok, device="cpu").eval()
    with torch.no_grad():
        h = plain.model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert float(plain.score.weight.norm()) * float(h.norm(dim=-1).max()) < 1

    save_model(plain, tok, tmp_path / "rm")
    again = load_reward_model(str(tmp_path / "rm"), tok, device="cpu", head_batch=(ids, mask))
    assert torch.equal(again.score.weight, plain.score.weight)


def test_a_fresh_head_on_alike_sequences_falls_back_to_the_fan_in_draw(tiny_model_dir, tok):
    """Scores with no spread to measure (one sequence, or the same one twice) leave the
    N(0, 1) draw scaled by 1/√H, finite, rather than divided by a zero spread: |w|² is then
    a χ²_H/H (mean 1, sd √(2/H) = 0.25 at H = 32), where a division by a spread of float
    noise would give an |w|² of 1e6 or more."""
    _, _, batch = random_batch(7, [(3, 4)])
    ids, mask = batch["input_ids"].repeat(2, 1), batch["attention_mask"].repeat(2, 1)
    for n in (1, 2):
        torch.manual_seed(0)
        rm = load_reward_model(tiny_model_dir, tok, device="cpu",
                               head_batch=(ids[:n], mask[:n]))
        w2 = float(rm.score.weight.double().pow(2).sum())
        assert torch.isfinite(rm.score.weight).all() and 0.25 < w2 < 4, w2


def test_reward_model_save_reload(rm, tok, tmp_path):
    save_model(rm, tok, tmp_path / "rm")
    assert (tmp_path / "rm" / "model.safetensors").exists()
    rm2 = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert rm2.config.num_labels == 1
    assert rm2.config.pad_token_id == tok.pad_token_id
    assert torch.equal(rm2.score.weight, rm.score.weight)
    _, _, batch = random_batch(6, [(3, 4), (2, 2), (5, 1)])
    with torch.no_grad():
        a = sequence_scores(rm, batch["input_ids"], batch["attention_mask"])
        b = sequence_scores(rm2, batch["input_ids"], batch["attention_mask"])
        # plain transformers' own forward (it finds the last non-pad token by pad id)
        c = rm2(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # the same scores (a reloaded copy; transformers' own last-token pick): two forwards
    bound = pair_bound(model_stages(rm.config, False),
                       model_inner(rm.config, batch["input_ids"].numel()))
    scale = score_scale(rm, batch["input_ids"], batch["attention_mask"])
    assert_within(b, a, bound, scale)
    assert_within(c.squeeze(-1), a, bound, scale)


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "naïve café, Grüße, 日本語, emoji 🙂, ½ €",
    "a  b   c",
]


def test_byte_tokenizer_round_trip_after_save(tok, tmp_path):
    tok.save_pretrained(tmp_path / "tok")
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for t in TEXTS:
        ids = tok2(t, add_special_tokens=False)["input_ids"]
        assert ids == [3 + b for b in t.encode("utf-8")]  # one token per byte
        assert tok2.decode(ids) == t
        assert tok.decode(ids) == t
    with_eos = tok2("hi", add_special_tokens=False)["input_ids"] + [tok2.eos_token_id]
    assert tok2.decode(with_eos, skip_special_tokens=True) == "hi"
    assert len(tok2) == 259


def test_builtin_missing_model_message(monkeypatch, tmp_path):
    import posttrain.models.loading as modeling

    monkeypatch.setattr(modeling, "builtin_model_dir",
                        lambda name="builtin": Path(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="rebuild"):
        modeling.resolve("builtin")
    monkeypatch.setattr(modeling, "_check_hub", lambda name: None)  # as if cached
    assert modeling.resolve("some/hub-id") == "some/hub-id"


@pytest.mark.parametrize("packed,attn", [(True, "sdpa"), (True, "eager"), (False, "sdpa")])
def test_shared_prompt_logprobs_equal_full_sequences(tiny_model_dir, packed, attn):
    """Running each prompt once for its k=2 completions (left-padded prompts, right-padded
    completions) gives the same per-sequence log-likelihoods and parameter gradients as the
    concatenated full sequences, packed into one call (with the 4-D mask in either
    attention implementation's form) or in two calls."""
    from posttrain.models import load_causal_lm
    from shared_prompt import assert_shared_prompt_equals_full

    model = load_causal_lm(tiny_model_dir, device="cpu")
    model.set_attn_implementation(attn)
    assert_shared_prompt_equals_full(model, packed)


@pytest.mark.parametrize("packed", [True, False])
def test_shared_prompt_logprobs_prompt_index_uneven(tiny_model_dir, packed):
    """GRPO layout: any subset of a group's completions, in any order, several per prompt
    and none for some; per-token log-probs equal the full sequences' token by token."""
    import torch

    from posttrain.data import pad_left, pad_sequences
    from posttrain.models import completion_logprobs, load_causal_lm, shared_prompt_logprobs

    model = load_causal_lm(tiny_model_dir, device="cpu")
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    index = [2, 0, 2, 2, 0]  # prompt 1 has no completion here
    completions = [[20, 21, 22, 23], [22], [23, 24, 25], [30], [31, 32]]
    prompt_ids, prompt_mask = pad_left(prompts, 0)
    Lc = max(map(len, completions))
    comp_ids = torch.tensor([c + [0] * (Lc - len(c)) for c in completions])
    comp_mask = torch.tensor([[1] * len(c) + [0] * (Lc - len(c)) for c in completions])
    a = shared_prompt_logprobs(model, prompt_ids, prompt_mask, comp_ids, comp_mask,
                               prompt_index=torch.tensor(index), packed=packed)
    full = pad_sequences([prompts[i] for i in index], completions, 0)
    b = completion_logprobs(model, full["input_ids"], full["attention_mask"],
                            full["loss_mask"])
    bound = lp_bound(model, full["input_ids"])
    scale = lp_scale(model, full["input_ids"], full["attention_mask"])
    for r, c in enumerate(completions):
        got = a[r, :len(c)]
        want = b[r][full["loss_mask"][r, 1:].bool()]
        assert_within(got.detach(), want.detach(), bound, scale)
        assert torch.all(a[r, len(c):] == 0)


def test_pad_shared_prompts_layout():
    """Prompts left-padded once; completions right-padded in blocks."""
    import torch

    from posttrain.data import pad_shared_prompts

    out = pad_shared_prompts([[1, 2], [3]], [[4], [5, 6], [7, 8], [9]], 0)
    assert out["prompt_ids"].tolist() == [[1, 2], [0, 3]]
    assert out["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert out["completion_ids"].tolist() == [[4, 0], [5, 6], [7, 8], [9, 0]]
    assert torch.equal(out["completion_mask"], torch.tensor([[1, 0], [1, 1], [1, 1], [1, 0]]))


@pytest.mark.slow
def test_compiled_pointwise_blocks_match_eager(tiny_model_dir, tmp_path):
    """compile_pointwise_blocks compiles every RMSNorm and MLP block in place: log-probs and
    parameter gradients equal the eager model's (full sequences and the shared-prompt
    layout, training and inference mode), and the state dict and saved files are the same."""
    import copy

    from transformers import AutoModelForCausalLM

    from posttrain.data import pad_sequences, pad_shared_prompts
    from posttrain.fast.compile import compile_pointwise_blocks, compile_unsupported
    from posttrain.models import completion_logprobs, load_causal_lm, shared_prompt_logprobs

    if compile_unsupported(torch.device("cpu")):
        pytest.skip(compile_unsupported(torch.device("cpu")))
    eager = load_causal_lm(tiny_model_dir, device="cpu")
    fused = copy.deepcopy(eager)
    n_layers = eager.config.num_hidden_layers
    assert compile_pointwise_blocks(fused) == 3 * n_layers + 1  # 2 norms + MLP each, final norm
    assert compile_pointwise_blocks(fused) == 0  # already compiled
    assert list(fused.state_dict()) == list(eager.state_dict())

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    completions = [[20, 21], [22], [23, 24, 25], [30], [31, 32, 33], [34, 35]]
    full = pad_sequences(prompts * 2, completions, 0)
    shared = pad_shared_prompts(prompts, completions, 0)

    def run(model, layout, scales=None):
        model.zero_grad()
        if layout == "full":
            lp = completion_logprobs(model, full["input_ids"], full["attention_mask"],
                                     full["loss_mask"])
        else:
            lp = shared_prompt_logprobs(model, shared["prompt_ids"], shared["prompt_mask"],
                                        shared["completion_ids"], shared["completion_mask"],
                                        packed=False)
        if scales is not None:  # the per-token terms each gradient sums
            scales[:] = grad_term_scales(lp[lp != 0], list(model.parameters()))
        lp.sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters()]

    # compiled blocks fuse the pointwise ops (another rounding of each) around the same
    # reductions: two float32 computations of the log-probs and gradients (lp_bound)
    ids = full["input_ids"]
    scale, bound, grad_bound = lp_scale(eager, ids, full["attention_mask"]), \
        lp_bound(eager, ids), lp_bound(eager, ids, backward=True)

    torch._dynamo.reset()  # compile afresh: the counter below then shows the blocks ran compiled
    torch._dynamo.utils.counters.clear()
    for layout in ("full", "shared"):
        scales = []
        lp_e, g_e = run(eager, layout, scales)
        lp_f, g_f = run(fused, layout)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
        assert_within(lp_f, lp_e, bound, scale, layout)
        for (name, _), a, b, sc in zip(eager.named_parameters(), g_f, g_e, scales, strict=True):
            assert_within(a, b, grad_bound, sc, name)
    with torch.inference_mode():
        assert_within(
            completion_logprobs(fused, full["input_ids"], full["attention_mask"],
                                full["loss_mask"]),
            completion_logprobs(eager, full["input_ids"], full["attention_mask"],
                                full["loss_mask"]), bound, scale, "inference mode")
    fused.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for (k, v), (k2, v2) in zip(reloaded.state_dict().items(), eager.state_dict().items(),
                                strict=True):
        assert k == k2 and torch.equal(v, v2)


@pytest.mark.slow
def test_compiled_pointwise_blocks_bfloat16_as_close_to_float32_as_eager():
    """In bfloat16 the compiled blocks round differently from eager; measured against the
    float32 model they stay about as close as eager bfloat16 does (log-probs and the whole
    gradient, relative error norm)."""
    from compiled import compiled_errors
    from posttrain.fast.compile import compile_unsupported

    if compile_unsupported(torch.device("cpu")):
        pytest.skip(compile_unsupported(torch.device("cpu")))
    err = compiled_errors("bfloat16", "cpu")
    # measured: log-probs 0.0033 against 0.0031, gradient 0.026 against 0.012
    assert err["lp_compiled_vs_fp32"] <= 3 * err["lp_eager_vs_fp32"] + 1e-3
    assert err["g_compiled_vs_fp32"] <= 3 * err["g_eager_vs_fp32"] + 1e-2
    assert err["g_vs_eager"] > 0  # the compiled path really ran: its rounding differs


def _attention_used(model, **inputs) -> tuple[list[str], torch.Tensor]:
    """Run ``model(**inputs)`` and record the attention implementation each layer ran."""
    seen: list[str] = []
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a: seen.append(m.config._attn_implementation))
        for layer in model.base_model.layers]
    try:
        out = model(**inputs).logits
    finally:
        for h in hooks:
            h.remove()
    return seen, out


@pytest.mark.parametrize("length", [30, 200])
def test_short_inputs_run_eager_attention_as_exact_as_sdpa(length):
    """On the CPU a loaded model runs eager attention up to EAGER_ATTENTION_MAX_KEYS keys and
    SDPA above. Against a float64 model, its values and every gradient meet the float32
    error bound of the computation, as a plain float32 SDPA model's do (the two differ by
    summation order only)."""
    from posttrain.fast.attention import EAGER_ATTENTION_MAX_KEYS
    from posttrain.models import builtin_model_dir

    ours = prepare_model(load_causal_lm("builtin", device="cpu"))
    path = builtin_model_dir()
    plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    exact = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").double()
    torch.manual_seed(0)
    ids = torch.randint(3, 200, (3, length))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding in one row
    keep = mask.bool()
    seen, a = _attention_used(ours, input_ids=ids, attention_mask=mask)
    want = "eager" if length <= EAGER_ATTENTION_MAX_KEYS else "sdpa"
    assert seen == [want] * len(ours.base_model.layers)
    b = plain(input_ids=ids, attention_mask=mask).logits
    c = exact(input_ids=ids, attention_mask=mask).logits
    for out in (a, b, c):
        out[keep].square().mean().backward()

    def err(x, y):
        return float((x.double() - y).norm() / y.norm())

    pairs = [("logits", a[keep], b[keep], c[keep])] + [
        (name, p.grad, q.grad, r.grad) for (name, p), q, r in
        zip(ours.named_parameters(), plain.parameters(), exact.parameters(), strict=True)]
    # both float32 paths meet the same bound against float64 (forward + backward)
    bound = rel_bound(model_stages(ours.config), model_inner(ours.config, length))
    for name, x, y, z in pairs:
        assert err(x, z) <= bound, (name, err(x, z), bound)
        assert err(y, z) <= bound, (name, err(y, z), bound)


def test_key_length_counts_cached_positions():
    """With a KV cache the key length is cached + new positions: 100 cached + 40 new is past
    the eager limit, 100 + 20 is not."""
    from transformers import DynamicCache

    from posttrain.models import cache_kwarg

    model = prepare_model(load_causal_lm("builtin", device="cpu")).eval()
    kw = cache_kwarg(model)
    for new, want in ((40, "sdpa"), (20, "eager")):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=torch.randint(3, 200, (2, 100)), use_cache=True, **{kw: cache})
            seen, _ = _attention_used(model, input_ids=torch.randint(3, 200, (2, new)),
                                      use_cache=True, **{kw: cache})
        assert set(seen) == {want}


def test_a_model_moved_off_the_cpu_goes_back_to_sdpa():
    from posttrain.fast.attention import attention_for_keys

    model = prepare_model(load_causal_lm("builtin", device="cpu"))
    assert attention_for_keys(model, 10) == "eager"
    model.to("meta")  # stands in for a GPU: any device but the CPU
    assert attention_for_keys(model, 10) == "sdpa"
    assert model.config._attn_implementation == "sdpa"
