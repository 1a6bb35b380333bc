"""The batched rollout sampler, each property checked against an independent computation:
``transformers.generate`` for greedy decoding, a plain full forward (teacher forcing) for
the sampling log-probabilities and the top-k / top-p supports, and string search for stop
strings."""

from __future__ import annotations

import math

import pytest
import torch

from bounds import logprob_scale, logprob_tolerance, logsoftmax_error, unit_roundoff
from posttrain.data import pad_sequences
from posttrain.models import completion_logprobs, load_causal_lm, load_tokenizer
from posttrain.rollout import SamplingParams, generate

TINY_PROMPTS = ["hello", "a", "the quick brown fox"]  # different lengths: left padding matters
# greedy answers of the builtin model: "115", "81", "55", "101" (rows end at different steps)
ADD_PROMPTS = ["58+67=", "40+41=", "22+33=", "12+99="]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, device="cpu").eval(), load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def builtin():
    return load_causal_lm("builtin", device="cpu").eval(), load_tokenizer("builtin")


def hf_greedy(model, tok, prompts: list[str], max_new_tokens: int) -> torch.Tensor:
    """``transformers.generate`` greedy completions (left-padded prompts), ``(P, T)``."""
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        enc = tok(prompts, return_tensors="pt", padding=True)
    finally:
        tok.padding_side = side
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return out[:, enc["input_ids"].shape[1]:]


def completions(r) -> list[list[int]]:
    """The generated tokens of each row (mask 1), as lists."""
    return [ids[m.bool()].tolist() for ids, m in zip(r.completion_ids, r.completion_mask,
                                                     strict=True)]


def teacher_logits(model, r) -> list[torch.Tensor]:
    """Per row, the full-forward logits ``(L_i, V)`` that predict its ``L_i`` completion
    tokens (prompt + completion, right-padded, no cache)."""
    comps = completions(r)
    batch = pad_sequences(r.prompt_ids, comps, pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits.float()
    out = []
    for i, (p, c) in enumerate(zip(r.prompt_ids, comps, strict=True)):
        out.append(logits[i, len(p) - 1:len(p) + len(c) - 1])
    return out


def check_padding(r, pad_id: int) -> None:
    off = r.completion_mask == 0
    assert (r.completion_ids[off] == pad_id).all()
    assert (r.logprobs[off] == 0).all()
    # the mask is a prefix: ones, then zeros
    assert (r.completion_mask[:, 1:] <= r.completion_mask[:, :-1]).all()


# ---------------------------------------------------------------- 1. greedy = HF generate


def test_greedy_matches_hf_generate_without_eos(tiny):
    model, tok = tiny
    T = 7
    r = generate(model, tok, TINY_PROMPTS, n=1, params=SamplingParams(temperature=0,
                                                                       max_new_tokens=T))
    ref = hf_greedy(model, tok, TINY_PROMPTS, T)
    assert ref.shape == (3, T) and not (ref == tok.eos_token_id).any()  # the premise
    assert torch.equal(r.completion_ids, ref)
    assert r.truncated.tolist() == [True] * 3
    assert r.lengths.tolist() == [T] * 3
    assert r.completion_mask.shape == (3, T) and (r.completion_mask == 1).all()
    assert r.texts == tok.batch_decode(ref, skip_special_tokens=True)
    assert (r.logprobs == 0).all()  # greedy samples from a point mass


def test_greedy_matches_hf_generate_with_eos(builtin):
    model, tok = builtin
    n, T = 2, 8
    r = generate(model, tok, ADD_PROMPTS, n=n, params=SamplingParams(temperature=0,
                                                                      max_new_tokens=T))
    ref = hf_greedy(model, tok, ADD_PROMPTS, T).repeat_interleave(n, dim=0)
    eos = tok.eos_token_id
    # every row ends with eos, at different steps (so rows leave the cache at different times)
    is_eos = ref == eos
    assert is_eos.any(-1).all()
    first_eos = is_eos.float().argmax(-1)
    assert len(set(first_eos.tolist())) > 1
    assert torch.equal(r.completion_ids, ref)  # HF pads after eos with the pad id too
    expected_mask = (torch.arange(ref.shape[1])[None] <= first_eos[:, None]).long()
    assert torch.equal(r.completion_mask, expected_mask)
    assert r.lengths.tolist() == (first_eos + 1).tolist()
    assert not r.truncated.any()
    assert r.texts == tok.batch_decode(ref, skip_special_tokens=True)
    assert r.texts[::n] == ["115", "81", "55", "101"]
    check_padding(r, tok.pad_token_id)


# ------------------------------------------------- 2. sampling log-probs = teacher forcing


@pytest.mark.parametrize("which", ["tiny", "builtin"])
def test_logprobs_match_teacher_forcing(which, tiny, builtin):
    model, tok = tiny if which == "tiny" else builtin
    prompts = TINY_PROMPTS if which == "tiny" else ["10+11=", "58+67=", "95+98="]
    r = generate(model, tok, prompts, n=3, params=SamplingParams(temperature=1.0, top_k=0,
                                                                  top_p=1.0, max_new_tokens=6),
                 generator=torch.Generator().manual_seed(0))
    check_padding(r, tok.pad_token_id)
    if which == "builtin":  # rows of different lengths: some positions are masked
        assert (r.completion_mask == 0).any() and not r.truncated.all()
    batch = pad_sequences(r.prompt_ids, completions(r), pad_id=tok.pad_token_id)
    with torch.no_grad():
        ref = completion_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                  batch["loss_mask"])
    target = batch["loss_mask"][:, 1:].bool()
    ref_rows = [ref[i][target[i]] for i in range(len(ref))]
    got_rows = [r.logprobs[i][r.completion_mask[i].bool()] for i in range(len(ref))]
    for got, want in zip(got_rows, ref_rows, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want.float(), rtol=0, atol=logprob_tolerance(model, model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits))  # noqa: E501
    assert (r.logprobs[r.completion_mask.bool()] < 0).all()


def test_temperature_logprobs_are_of_the_scaled_distribution(tiny):
    model, tok = tiny
    tau = 0.5
    r = generate(model, tok, TINY_PROMPTS, n=2,
                 params=SamplingParams(temperature=tau, max_new_tokens=5),
                 generator=torch.Generator().manual_seed(3))
    for i, logits in enumerate(teacher_logits(model, r)):
        ids = r.completion_ids[i, :len(logits)]
        want = (logits / tau).log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
        torch.testing.assert_close(r.logprobs[i, :len(logits)], want, rtol=0,
                                   atol=logprob_tolerance(model, logits / tau))


# ------------------------------------------------------- 3. groups, diversity, seeding


def test_groups_and_seeding(tiny):
    model, tok = tiny
    n = 4
    params = SamplingParams(temperature=1.0, max_new_tokens=8)

    def run(seed):
        return generate(model, tok, TINY_PROMPTS, n=n, params=params,
                        generator=torch.Generator().manual_seed(seed))

    r = run(0)
    P = len(TINY_PROMPTS)
    assert r.group_ids.tolist() == [g for g in range(P) for _ in range(n)]
    assert r.completion_ids.shape == (P * n, 8) and len(r.texts) == P * n
    for g, prompt in enumerate(TINY_PROMPTS):
        ids = tok(prompt)["input_ids"]
        assert r.prompt_ids[g * n:(g + 1) * n] == [ids] * n
        rows = {tuple(x) for x in r.completion_ids[g * n:(g + 1) * n].tolist()}
        assert len(rows) == n  # the n samples of one prompt differ
    again = run(0)
    assert torch.equal(again.completion_ids, r.completion_ids)
    assert torch.equal(again.logprobs, r.logprobs)
    assert again.texts == r.texts
    other = run(1)
    assert not torch.equal(other.completion_ids, r.completion_ids)


# ------------------------------------------------------------------- 4. top-k and top-p


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6),
                                    SamplingParams(temperature=1.0, top_p=1e-6,
                                                   max_new_tokens=6)],
                         ids=["top_k=1", "top_p=1e-6"])
def test_degenerate_truncation_is_greedy(tiny, builtin, params):
    for model, tok, prompts in [(*tiny, TINY_PROMPTS), (*builtin, ADD_PROMPTS)]:
        greedy = generate(model, tok, prompts, n=2, params=SamplingParams(
            temperature=0, max_new_tokens=params.max_new_tokens))
        r = generate(model, tok, prompts, n=2, params=params,
                     generator=torch.Generator().manual_seed(0))
        assert torch.equal(r.completion_ids, greedy.completion_ids)
        assert torch.equal(r.completion_mask, greedy.completion_mask)
        assert torch.equal(r.truncated, greedy.truncated)
        assert r.texts == greedy.texts
        assert r.logprobs.abs().max() < 1e-6  # a point mass


def test_top_k_support_and_renormalised_logprobs(tiny):
    model, tok = tiny
    k = 5
    r = generate(model, tok, TINY_PROMPTS, n=4,
                 params=SamplingParams(temperature=1.0, top_k=k, max_new_tokens=8),
                 generator=torch.Generator().manual_seed(0))
    ranks = []
    for i, logits in enumerate(teacher_logits(model, r)):
        ids = r.completion_ids[i, :len(logits)]
        chosen = logits.gather(-1, ids[:, None])  # (L, 1)
        rank = (logits > chosen + 1e-5).sum(-1)  # tokens clearly more likely than the sample
        assert (rank < k).all()
        ranks += rank.tolist()
        plain = logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
        got = r.logprobs[i, :len(logits)]
        assert (got >= plain).all()
        renorm = plain - logits.log_softmax(-1).topk(k, dim=-1).values.logsumexp(-1)
        torch.testing.assert_close(got, renorm, rtol=0, atol=logprob_tolerance(model, logits, 2))
    assert max(ranks) > 0  # not just greedy


def test_top_p_support_and_renormalised_logprobs(tiny):
    model, tok = tiny
    top_p = 0.1
    r = generate(model, tok, TINY_PROMPTS, n=4,
                 params=SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=8),
                 generator=torch.Generator().manual_seed(0))
    for i, logits in enumerate(teacher_logits(model, r)):
        ids = r.completion_ids[i, :len(logits)]
        probs = logits.softmax(-1)
        p_tok = probs.gather(-1, ids[:, None])
        # the nucleus: tokens whose more likely predecessors hold less than top_p of the mass
        mass_before = (probs * (probs > p_tok)).sum(-1)
        assert (mass_before < top_p + 1e-5).all()
        sorted_p = probs.sort(-1, descending=True).values
        kept = (sorted_p.cumsum(-1) - sorted_p) < top_p
        nucleus_mass = (sorted_p * kept).sum(-1)
        want = p_tok.squeeze(-1).log() - nucleus_mass.log()
        torch.testing.assert_close(r.logprobs[i, :len(logits)], want, rtol=0,
                                   atol=logprob_tolerance(model, logits, 3))  # + the cumsum


# ---------------------------------------------------------------------- 5. stop strings


@pytest.mark.parametrize("stop", [("1",), ("15", "xyz")])
def test_stop_string_greedy(builtin, stop):
    model, tok = builtin
    T = 8
    plain = generate(model, tok, ADD_PROMPTS, n=1, params=SamplingParams(temperature=0,
                                                                          max_new_tokens=T))
    r = generate(model, tok, ADD_PROMPTS, n=1, params=SamplingParams(temperature=0,
                                                                      max_new_tokens=T,
                                                                      stop=stop))
    check_padding(r, tok.pad_token_id)
    stopped = 0
    for i, full in enumerate(plain.texts):  # "115", "81", "55", "101"
        hits = [(j + len(s), s) for s in stop if (j := full.find(s)) >= 0]
        if hits:
            stopped += 1
            end = min(hits)[0]  # characters (= byte tokens) up to the completed stop string
            assert r.texts[i] == full[:full.find(min(hits)[1])]
            assert r.lengths[i] == end
            assert not r.truncated[i]
            assert r.completion_ids[i, :end].tolist() == plain.completion_ids[i, :end].tolist()
            assert tok.decode(r.completion_ids[i, :end]).endswith(min(hits)[1])
        else:  # unaffected
            L = plain.lengths[i]
            assert r.texts[i] == full
            assert r.lengths[i] == L
            assert r.truncated[i] == plain.truncated[i]
            assert torch.equal(r.completion_ids[i, :L], plain.completion_ids[i, :L])
    assert 0 < stopped < len(ADD_PROMPTS)


def test_stop_string_sampled_rows_end_where_it_completes(builtin):
    model, tok = builtin
    stop = ("1",)
    r = generate(model, tok, ["58+67=", "95+98=", "10+11="], n=6,
                 params=SamplingParams(temperature=1.0, max_new_tokens=5, stop=stop),
                 generator=torch.Generator().manual_seed(0))
    check_padding(r, tok.pad_token_id)
    eos = tok.eos_token_id
    n_stop = 0
    for ids, L, text, trunc in zip(r.completion_ids, r.lengths.tolist(), r.texts,
                                   r.truncated.tolist(), strict=True):
        assert "1" not in text
        full = tok.decode(ids[:L], skip_special_tokens=True)
        if ids[L - 1] == eos:
            assert not trunc and "1" not in full
        elif "1" in full:  # finished by the stop string, at the token that completed it
            n_stop += 1
            assert not trunc
            assert "1" not in tok.decode(ids[:L - 1], skip_special_tokens=True)
            assert text == full[:full.index("1")]
        else:
            assert trunc and L == 5
    assert n_stop > 0


# ------------------------------------------------------------------- 6. validation


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=-0.5),
                                 dict(top_p=1.01), dict(top_k=-1), dict(max_new_tokens=0)])
def test_validate_rejects(bad, tiny):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()
    model, tok = tiny
    with pytest.raises(ValueError):  # generate validates too
        generate(model, tok, ["a"], params=SamplingParams(**bad))


def test_validate_accepts_edges():
    SamplingParams(temperature=0, top_p=1.0, top_k=0, max_new_tokens=1).validate()
    SamplingParams(temperature=2.0, top_p=1e-9, top_k=1).validate()


# --------------------------------------------------------------------- 7. edge sizes


def test_one_new_token(tiny, builtin):
    model, tok = tiny
    r = generate(model, tok, TINY_PROMPTS, n=2, params=SamplingParams(max_new_tokens=1),
                 generator=torch.Generator().manual_seed(0))
    assert r.completion_ids.shape == r.completion_mask.shape == r.logprobs.shape == (6, 1)
    assert (r.completion_mask == 1).all()
    assert r.truncated.tolist() == (r.completion_ids[:, 0] != tok.eos_token_id).tolist()
    ref = hf_greedy(model, tok, TINY_PROMPTS, 1)
    g = generate(model, tok, TINY_PROMPTS, params=SamplingParams(temperature=0,
                                                                  max_new_tokens=1))
    assert torch.equal(g.completion_ids, ref)
    model, tok = builtin  # a budget of one: the digit comes, the eos does not
    r = generate(model, tok, ["40+41="], params=SamplingParams(temperature=0,
                                                                max_new_tokens=1))
    assert r.texts == ["8"] and r.truncated.tolist() == [True]


def test_single_prompt_single_sample(builtin):
    model, tok = builtin
    model.train()  # generate runs in eval mode and restores the mode
    try:
        r = generate(model, tok, ["58+67="], n=1, params=SamplingParams(temperature=0,
                                                                         max_new_tokens=8))
        assert model.training
    finally:
        model.eval()
    assert r.completion_ids.shape == (1, 4)
    assert r.group_ids.tolist() == [0] and r.prompt_ids == [tok("58+67=")["input_ids"]]
    assert r.texts == ["115"] and r.lengths.tolist() == [4] and not r.truncated.any()
    ref = hf_greedy(model, tok, ["58+67="], 8)
    assert torch.equal(r.completion_ids, ref)


def test_sampler_matches_the_distribution():
    """The inverse-CDF sampler draws each token with its softmax probability (and
    top-k renormalises): empirical frequencies over 40,000 draws within 4 standard errors."""
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.engine import sample_tokens as _sample

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(40_000, 1)
    gen = torch.Generator().manual_seed(0)
    for params, probs in (
        (SamplingParams(), torch.softmax(logits[0], -1)),
        (SamplingParams(temperature=0.5), torch.softmax(logits[0] / 0.5, -1)),
        (SamplingParams(top_k=2), torch.softmax(torch.tensor([2.0, 1.0]), -1)),
    ):
        tokens, logp = _sample(logits, params, gen)
        freq = torch.bincount(tokens, minlength=5).double()[: len(probs)] / len(tokens)
        se = (probs.double() * (1 - probs.double()) / len(tokens)).sqrt()
        assert ((freq - probs.double()).abs() <= 4 * se + 1e-12).all(), (freq, probs)
        # both sides float32 log-softmax-like (the reference a softmax then a log: its
        # relative error becomes absolute), each within logsoftmax_error of the exact value
        # of logits scaled by 1/T (one more rounding); the probabilities differ by ≥ 0.1
        tol = 2 * logsoftmax_error(logits[:1] / params.temperature) + 2 * unit_roundoff()
        assert (logp - probs.log()[tokens]).abs().max() <= tol


@pytest.mark.parametrize("blocks", [0, 2], ids=["one-block", "blocks-and-tail"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_blocked_sampler_is_the_inverse_cdf_over_a_large_vocabulary(temperature, blocks):
    """Over a vocabulary of two CDF blocks and a ragged tail (or of less than one block), each
    draw is the token a float64 inverse CDF picks for the same uniform number, except where
    that number lies within float32 rounding of the boundary between the two tokens;
    log-probs are log-softmax's."""
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.engine import CDF_BLOCK
    from posttrain.rollout.engine import sample_tokens as _sample

    V, R = blocks * CDF_BLOCK + 777, 4000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(R, V, generator=g) * 3
    logits[:, 5] += 8  # rows with most of their mass in block 0 ...
    logits[: R // 2, V - 3] += 12  # ... or in the tail
    u = torch.rand(R, generator=g)
    tokens, logp = _sample(logits, SamplingParams(temperature=temperature), None, u)
    x = logits.double() / temperature
    cdf = x.softmax(-1).cumsum(-1)
    ref = torch.searchsorted(cdf, u.double()[:, None] * cdf[:, -1:]).squeeze(-1)
    assert tokens.max() < V and tokens.min() >= 0
    # float32: exp and the division each round once (2u), a block sum of CDF_BLOCK terms and
    # the running sum over blocks add at most (CDF_BLOCK + V / CDF_BLOCK)·u of the total
    tol = (CDF_BLOCK + V // CDF_BLOCK + 8) * 2.0 ** -24
    off = (tokens != ref).nonzero().squeeze(-1)
    boundary = cdf[off, torch.minimum(tokens, ref)[off]]
    assert ((boundary - u.double()[off]).abs() <= tol).all()
    assert len(off) <= R // 100  # boundaries are rare, not the rule
    want = x.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    # float32 (z − max)/T − log Σ exp against float64: logsoftmax_error of the scaled logits,
    # and the division by T rounds once more on a value ≤ logprob_scale
    tol = logsoftmax_error(x.float()) + unit_roundoff() * logprob_scale(x.float())
    torch.testing.assert_close(logp.double(), want, rtol=0, atol=tol)


def test_the_blocked_sampler_never_picks_a_token_of_probability_zero():
    """Where the block sums and the chosen block's running sum round apart, a target in the
    gap takes the block's last token with mass, not a cut one (-inf logit).

    The gap is built, not searched for: a block of one 1.0 and then values just above half
    an ulp of 1.0 (2⁻²⁴·(1 + 2⁻⁸)). A float32 sum that adds any of them to the accumulator
    holding the 1.0 rounds each such addition up to a whole ulp, so the block's sum exceeds
    the correctly rounded total; the running sum (accumulated in double on the CPU, rounded
    per element) is that correctly rounded total. Any kernel's vector width or order keeps
    the 1.0 in one accumulator lane that later values join, so the gap is there on all."""
    from posttrain.rollout.sampling import CDF_BLOCK, _inverse_cdf

    B = CDF_BLOCK
    z = torch.full((1, 2 * B), math.log(2.0 ** -24 * (1 + 2.0 ** -8)))
    z[0, 0] = 0.0
    z[0, B - 1] = float("-inf")  # the block's last column is cut
    e = (z - z.max()).exp()
    block_sum = e[:, :B].view(1, 1, B).sum(-1)[0, 0]
    running = e[:, :B].cumsum(-1)[0, -1]
    assert running < block_sum  # the construction's premise (see the docstring)
    total = e.view(1, 2, B).sum(-1).cumsum(-1)[0, -1]
    u = ((running + block_sum) / 2 / total).view(1)
    tokens, logp = _inverse_cdf(z, 1.0, u)
    assert int(tokens) == B - 2  # the block's last token with mass
    assert torch.isfinite(z[0, tokens]).all() and torch.isfinite(logp).all()


def _assert_lean_equals_hf(model, tok):
    """Greedy and sampled (same seed): identical tokens and masks, log-probs within the
    derived bound."""
    from posttrain.fast.lean import LeanLlamaDecoder
    from posttrain.rollout import SamplingParams, generate

    assert LeanLlamaDecoder.supports(model)
    prompts = ["58+67=", "1+2=", "99+99="]
    for params in (SamplingParams(temperature=0, max_new_tokens=6),
                   SamplingParams(temperature=1.0, max_new_tokens=6)):
        a = generate(model, tok, prompts, 4, params, torch.Generator().manual_seed(1),
                     engine="lean")
        b = generate(model, tok, prompts, 4, params, torch.Generator().manual_seed(1),
                     engine="hf")
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.completion_mask, b.completion_mask)
        # two float32 incremental forwards of one decoder (other kernels, other cache
        # layouts), each within rel_bound of exact: pair_bound(model stages + the
        # log-softmax, the longest reduction) x the terms' size on these logits
        # (bounds.logprob_tolerance): ~3e-3 on the shipped model, so a wrong position or
        # token (0.1-1 nats off) is beyond it, a 1% error of a log-prob near 0 is not
        atol = logprob_tolerance(model, torch.cat(teacher_logits(model, b)))
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)


def _tiny_config(tok, kv_heads: int) -> dict:
    """The config keys of the lean-decoder tests' tiny models: 2 layers, 4 query heads."""
    return dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


@pytest.mark.parametrize("model_name", ["tiny", "builtin"])
def test_lean_decoder_equals_model_forward(tiny_model_dir, model_name):
    """The lean static-cache decoder gives the same tokens and log-probs as decoding through
    the model's own forward, greedy and sampled with the same seed."""
    from posttrain.models import load_causal_lm, load_tokenizer

    path = tiny_model_dir if model_name == "tiny" else "builtin"
    model, tok = load_causal_lm(path, device="cpu"), load_tokenizer(path)
    _assert_lean_equals_hf(model, tok)


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_bias"])
def test_lean_decoder_equals_model_forward_gqa_and_bias(tiny_model_dir, arch):
    """The same equality with grouped-query attention (4 query heads on 1 key/value head) and
    with the q/k/v biases of Qwen2, the two paths of the fused projection that the shipped
    model does not exercise."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from posttrain.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    common = _tiny_config(tok, kv_heads=1)
    torch.manual_seed(0)
    if arch == "llama_gqa":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        with torch.no_grad():  # non-zero biases, so a dropped bias would show
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.eval()
    _assert_lean_equals_hf(model, tok)


@pytest.mark.parametrize("seed", range(20))
def test_compaction_keeps_live_rows_and_moves_only_finished_slots(seed):
    """The cache order after rows finish: exactly the live rows, each once; a live row in
    the first ``n`` slots stays in its slot; only as many slots change as finished there."""
    from posttrain.rollout.engine import compaction as _compaction

    g = torch.Generator().manual_seed(seed)
    R = int(torch.randint(1, 40, (1,), generator=g))
    live = torch.rand(R, generator=g) < float(torch.rand(1, generator=g))
    rows = _compaction(live)
    n = int(live.sum())
    assert sorted(rows.tolist()) == live.nonzero().squeeze(-1).tolist()
    head = torch.arange(n)
    stays = live[:n]
    assert torch.equal(rows[stays], head[stays])
    assert int((rows != head).sum()) == int((~stays).sum())


def test_rows_finishing_at_many_steps_keep_teacher_forced_logprobs(tiny_model_dir,
                                                                   monkeypatch):
    """A random model whose eos logit is scaled up, prompts of different lengths: rows end at
    many different steps, the cache is compacted several times with rows moving slots
    (counted), and every sampled token's log-prob still equals a full forward's."""
    from posttrain.fast.lean import LeanLlamaDecoder

    model = load_causal_lm(tiny_model_dir, device="cpu").eval()
    tok = load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 20
    moved: list[int] = []
    select = LeanLlamaDecoder.select

    def counting(self, rows):
        moved.append(int((rows != torch.arange(len(rows))).sum()))
        return select(self, rows)

    monkeypatch.setattr(LeanLlamaDecoder, "select", counting)
    r = generate(model, tok, TINY_PROMPTS, n=8, params=SamplingParams(temperature=1.0,
                                                                      max_new_tokens=12),
                 generator=torch.Generator().manual_seed(0), engine="lean")
    assert sum(m > 0 for m in moved) >= 3
    assert len(set(r.lengths.tolist())) >= 4
    check_padding(r, tok.pad_token_id)
    batch = pad_sequences(r.prompt_ids, completions(r), pad_id=tok.pad_token_id)
    with torch.no_grad():
        ref = completion_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                  batch["loss_mask"])
    target = batch["loss_mask"][:, 1:].bool()
    for i in range(len(ref)):
        got = r.logprobs[i][r.completion_mask[i].bool()]
        torch.testing.assert_close(got, ref[i][target[i]].float(), rtol=0, atol=logprob_tolerance(model, model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits))  # noqa: E501


def test_mlp_biases_keep_the_model_forward(tiny_model_dir):
    """The lean decoder fuses gate and up without biases, so a Llama with ``mlp_bias`` is
    decoded through the model's own forward: ``auto`` samples what ``hf`` does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.fast.lean import LeanLlamaDecoder
    from posttrain.rollout import SamplingParams, generate

    tok = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, mlp_bias=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.bias.normal_(0, 2.0)
    assert not LeanLlamaDecoder.supports(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    a = generate(model, tok, ["1+2="], 4, params, torch.Generator().manual_seed(1))
    b = generate(model, tok, ["1+2="], 4, params, torch.Generator().manual_seed(1),
                 engine="hf")
    assert torch.equal(a.completion_ids, b.completion_ids)


class _Scaled(torch.nn.Module):
    """A projection with something wrapped around it (as an adapter would be)."""

    def __init__(self, inner: torch.nn.Linear):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 3.0 * self.inner(x)


def test_wrapped_projections_keep_the_model_forward(tiny_model_dir):
    """The lean decoder reads the projections' weights, so a model with a projection
    wrapped in another module is decoded through the model's own forward: ``auto`` samples
    what ``hf`` does, and differs from what the bare weights would give."""
    from posttrain.fast.lean import LeanLlamaDecoder
    from posttrain.rollout import SamplingParams, generate

    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, device="cpu").eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    prompts = ["1+2=", "17+25="]
    bare = generate(model, tok, prompts, 4, params, torch.Generator().manual_seed(1))
    for layer in model.model.layers:
        layer.self_attn.o_proj = _Scaled(layer.self_attn.o_proj)
        layer.mlp.down_proj = _Scaled(layer.mlp.down_proj)
    assert not LeanLlamaDecoder.supports(model)
    a = generate(model, tok, prompts, 4, params, torch.Generator().manual_seed(1))
    b = generate(model, tok, prompts, 4, params, torch.Generator().manual_seed(1), engine="hf")
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.logprobs, b.logprobs)
    assert (a.logprobs[:, 0] - bare.logprobs[:, 0]).abs().max() > 1e-3


def test_engines_are_chosen_by_backend_and_fast(tiny_model_dir):
    """auto: lean for a plain Llama-family model with fast on, hf with fast off; lean asked
    for a model it cannot run is a clear error; both engines live for a run
    (sync, close) and sample the same greedy tokens."""
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.models.weights import hf_weights
    from posttrain.rollout import SamplingParams, make_engine, requests_for
    from posttrain.rollout.hf import HFEngine
    from posttrain.rollout.lean import LeanEngine

    model = load_causal_lm(tiny_model_dir, device="cpu")
    tok = load_tokenizer(tiny_model_dir)
    assert isinstance(make_engine("auto", model, tok), LeanEngine)
    assert isinstance(make_engine("auto", model, tok, fast=False), HFEngine)
    assert isinstance(make_engine("hf", model, tok), HFEngine)
    with pytest.raises(ValueError, match="unknown rollout backend"):
        make_engine("sglang", model, tok)
    model.config.sliding_window = 4  # no longer a model the lean decoder runs
    with pytest.raises(ValueError, match="rollout_backend=lean"):
        make_engine("lean", model, tok)
    model.config.sliding_window = None
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    texts = []
    for backend in ("lean", "hf"):
        engine = make_engine(backend, model, tok)
        engine.sync(hf_weights(model), 1)
        assert engine.version == 1
        out = engine.generate(requests_for(tok, ["12+3=", "4+4="]), 1, greedy)
        assert out.policy_version == 1 and len(out.finish_reasons) == 2
        texts.append(out.texts)
        cache = engine.generate(requests_for(tok, ["1+1="]), 2, greedy,
                                extras=frozenset({"projections"})).cache
        captured = cache is not None and cache.activations is not None
        assert captured is (backend == "lean") is ("projections" in engine.extras)
        engine.close()
    assert texts[0] == texts[1]


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_an_engine_on_a_copy_frees_it_while_asleep_and_a_sync_brings_it_back(builtin,
                                                                             backend):
    """An in-process engine on a module of its own (a sharded run's plain copy) frees, when
    put to sleep for the update, the tensors a sync refills, and says it needs one; the
    sync allocates them again, and the engine then draws exactly what it drew before.
    Before the first sync it frees nothing (nothing says yet what a sync sends); a stream
    that leaves out a freed tensor is refused."""
    import copy

    from posttrain.models.weights import hf_weights
    from posttrain.rollout import make_engine, requests_for

    model, tok = builtin
    engine = make_engine(backend, copy.deepcopy(model), tok, shares_weights=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    reqs = requests_for(tok, ADD_PROMPTS, [1, 2, 3, 4])
    before = engine.generate(reqs, 3, params)
    engine.sleep()
    assert not engine.needs_sync and all(p.numel() for p in engine.model.parameters())
    engine.sync(hf_weights(model, changed_only=True), 1)
    engine.sleep()
    sizes = [p.numel() for p in engine.model.parameters()]
    assert engine.needs_sync and sum(sizes) == 0
    engine.sync(hf_weights(model, changed_only=True), 2)
    assert not engine.needs_sync
    assert [p.shape for p in engine.model.parameters()] == [p.shape for p in model.parameters()]
    after = engine.generate(reqs, 3, params)
    assert torch.equal(after.completion_ids, before.completion_ids)
    assert torch.equal(after.logprobs, before.logprobs)
    engine.sleep()
    first = next(iter(dict(model.named_parameters())))
    partial = ((n, t) for n, t in hf_weights(model) if n != first)
    with pytest.raises(RuntimeError, match="left out tensors the engine freed"):
        engine.sync(partial, 3)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_lean_decoder_runs_mixture_of_experts_blocks(tiny_model_dir, arch):
    """Mixtral, Qwen2-MoE (a shared expert, q/k/v biases, top-k unnormalised) and Qwen3-MoE
    (per-head q and k norms, made non-trivial here so a skipped norm would show): the lean
    decoder runs each expert block as the model's own module, so tokens and log-probs are
    the hf engine's; it records the experts it routed to, the same as the hf engine's
    recording; and it refuses to capture projections it cannot replay."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from posttrain.fast.eligibility import can_replay
    from posttrain.fast.lean import LeanLlamaDecoder
    from posttrain.models import load_tokenizer
    from posttrain.models.routing import routers
    from posttrain.rollout import Request, SamplingParams, make_engine

    tok = load_tokenizer(tiny_model_dir)
    common = _tiny_config(tok, kv_heads=2)
    torch.manual_seed(0)
    if arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=6,
                                                 num_experts_per_tok=2))
    elif arch == "qwen2_moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, norm_topk_prob=False))
        assert model.model.layers[0].mlp.shared_expert is not None
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
            norm_topk_prob=True))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
                layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    with torch.no_grad():  # routers that route decisively, so recordings are comparable
        for r in routers(model):
            r.weight.normal_(0, 1.0)
    model.eval()
    _assert_lean_equals_hf(model, tok)
    assert not LeanLlamaDecoder.supports_dense(model) and not can_replay(model)
    requests = [Request((5, 6, 7, 8), 1), Request((9, 10), 2)]
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    got = [make_engine(name, model, tok).generate(requests, 2, params,
                                                  extras=frozenset({"routing"}))
           for name in ("lean", "hf")]
    assert torch.equal(got[0].completion_ids, got[1].completion_ids)
    assert got[0].routing is not None and torch.equal(got[0].routing, got[1].routing)
    with pytest.raises(ValueError, match="dense models only"):
        make_engine("lean", model, tok).generate(requests, 1, params,
                                                 extras=frozenset({"projections"}))


def test_held_prefixes_are_found_released_when_extended_and_retained():
    """A decoding engine's kept keys and values: a prompt takes its longest held prefix
    (one token at least left to run); a call's extended sequences are released after it;
    ``retain`` keeps only what a given sequence starts with."""
    from posttrain.rollout.prefixes import Prefixes

    kv = {k: (torch.full((1,), float(k[-1])),) * 2 for k in [(1, 2), (1, 2, 3), (7, 8)]}
    off = Prefixes()
    off.held = dict(kv)
    assert off.find([[1, 2, 3, 4]]) is None  # (outside reusing_prefixes(): nothing)
    on = Prefixes(on=True)
    on.held = dict(kv)
    got = on.find([[1, 2, 3, 4], [1, 2, 3], [5]])
    assert got[0] is kv[(1, 2, 3)] and got[1] is kv[(1, 2)] and got[2] is None
    assert on.find([[9]]) is None
    on.settle({(1, 2, 3, 4, 5): kv[(7, 8)]})
    assert set(on.held) == {(7, 8), (1, 2, 3, 4, 5)}
    on.held.update(kv)
    on.retain([(1, 2, 3, 9), (4,)])
    assert set(on.held) == {(1, 2, 3)}
    on.retain([(1, 2, 3)])  # (a sequence is its own prefix: kept)
    assert set(on.held) == {(1, 2, 3)}
    on.retain([])
    assert on.held == {}


def test_managed_prefixes_are_released_only_by_retain():
    """Requests that come one at a time (an agent's): a sequence two episodes hold stays
    after the first extends it, until ``retain`` leaves it out."""
    from posttrain.rollout.prefixes import Prefixes

    kv = (torch.zeros(1), torch.zeros(1))
    p = Prefixes(on=True, managed=True)
    p.held = {(1, 2): kv}
    assert p.find([[1, 2, 3]])[0] is kv
    p.settle({(1, 2, 3, 4): kv})
    assert p.find([[1, 2, 5]])[0] is kv  # (the other episode's request: still there)
    p.retain([(1, 2, 3, 4, 6)])
    assert set(p.held) == {(1, 2, 3, 4)}
