"""Padding-free packing (``sft --packing true``): the packed layout, and log-probs and
gradients of packed rows against the padded batch within derived bounds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bounds import (
    assert_within,
    grad_term_scales,
    logprob_scale,
    model_inner,
    model_stages,
    pair_bound,
)
from posttrain.data import pack_sequences, pad_sequences
from posttrain.models import completion_logprobs

PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 10, 11, 12, 13], [1, 14, 15]]
COMPLETIONS = [[20, 21, 2], [22, 2], [23, 24, 25, 26, 2], [27, 2]]


def test_the_packed_layout():
    """Sequences one after another, positions from 0 each, the loss on completions only; a
    budget starts a new row (a longer sequence alone); a row's pad tail is off the loss."""
    seqs = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]  # lengths 7 4 10 5
    out = pack_sequences(PROMPTS, COMPLETIONS, 0, budget=10)  # (7 + 4 > 10: a row each)
    assert out["input_ids"].tolist() == [s + [0] * (10 - len(s)) for s in seqs]
    one = pack_sequences(PROMPTS, COMPLETIONS, 0)
    assert one["input_ids"].tolist() == [[t for seq in seqs for t in seq]]
    assert one["position_ids"].tolist() == [list(range(7)) + list(range(4)) + list(range(10))
                                            + list(range(5))]
    assert one["loss_mask"].tolist() == [[0] * 4 + [1] * 3 + [0] * 2 + [1] * 2 + [0] * 5
                                         + [1] * 5 + [0] * 3 + [1] * 2]
    two = pack_sequences(PROMPTS, COMPLETIONS, 0, budget=14)  # 7 + 4 | 10 | 5
    assert two["input_ids"].shape == (3, 11)
    assert two["position_ids"][1].tolist() == [*range(10), 0]  # (the pad: a block of its own)
    assert two["loss_mask"][2, 5:].sum() == 0
    trained = pack_sequences(PROMPTS[:1], COMPLETIONS[:1], 0, [[1, 0, 1]])
    assert trained["loss_mask"].tolist() == [[0] * 4 + [1, 0, 1]]


@pytest.mark.parametrize("budget", [None, 12])
def test_packed_rows_give_the_padded_log_probs_and_gradients(tiny_model_dir, budget):
    """Each token's log-prob and every parameter gradient of the summed log-likelihood, packed
    against padded: two float32 forwards (and backwards) of the same quantities, so within
    ``pair_bound`` of the model's stages (+2: the log-softmax and the sum) and its longest
    reduction, times the terms' scale (tests/bounds.py). A sequence that saw another's
    tokens would be off by O(1)."""
    from posttrain.models import load_causal_lm

    model = load_causal_lm(tiny_model_dir, device="cpu")
    padded = pad_sequences(PROMPTS, COMPLETIONS, 0)
    packed = pack_sequences(PROMPTS, COMPLETIONS, 0, budget=budget)
    params = list(model.parameters())

    def run(batch, terms=False):
        model.zero_grad()
        lp = completion_logprobs(model, batch["input_ids"], batch.get("attention_mask"),
                                 batch["loss_mask"], position_ids=batch.get("position_ids"))
        scales = grad_term_scales(lp[lp != 0], params) if terms else None
        lp.sum().backward()
        return lp[batch["loss_mask"][:, 1:].bool()].detach(), \
            [p.grad.clone() for p in params], scales

    a, grads_a, scales = run(padded, terms=True)
    b, grads_b, _ = run(packed)
    cfg, tokens = model.config, padded["input_ids"].numel()
    with torch.no_grad():
        scale = logprob_scale(model(input_ids=padded["input_ids"],
                                    attention_mask=padded["attention_mask"]).logits)
    assert_within(b, a, pair_bound(model_stages(cfg, False) + 2, model_inner(cfg, tokens)),
                  scale, "token log-probs")
    bound = pair_bound(model_stages(cfg) + 2, model_inner(cfg, tokens))
    for (name, _), ga, gb, s in zip(model.named_parameters(), grads_a, grads_b, scales,
                                    strict=True):
        assert_within(gb, ga, bound, s, name)
    # (the bound can fail: without restarting positions the second sequence sees the first)
    leaky = completion_logprobs(model, packed["input_ids"], None, packed["loss_mask"])
    assert float((leaky[packed["loss_mask"][:, 1:].bool()] - a).abs().max()) > 1e-2


def test_sft_with_packing_trains_as_padded(tiny_model_dir, tmp_path):
    """``sft --packing true``: the first step's loss (before any update) equals the padded
    run's within the log-probs' bound (a mean of per-token terms), and the run completes."""
    from posttrain.cli import main

    rows = [{"prompt": "12+3=", "completion": "15"}, {"prompt": "4+4=", "completion": "8"},
            {"prompt": "30+41=", "completion": "71"}, {"prompt": "7+5=", "completion": "12"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    losses = []
    for name, extra in (("padded", ["--packing", "false"]), ("packed", ["--packing", "true",
                                                    "--max_tokens_per_micro_batch", "16"])):
        out = tmp_path / name
        assert main(["sft", "--model", tiny_model_dir, "--data", str(tmp_path / "d.jsonl"),
                     "--batch_size", "4", "--max_steps", "2", "--log_every", "1",
                     "--device", "cpu", "--tensorboard", "false", "--output_dir", str(out),
                     *extra]) == 0
        first = next(json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                     if '"train/loss"' in x)
        losses.append(first["train/loss"])
    from posttrain.data import encode_sft
    from posttrain.models import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm(tiny_model_dir, device="cpu"), load_tokenizer(tiny_model_dir)
    examples = encode_sft(tok, "d.jsonl", [{**r, "_row": i + 1} for i, r in enumerate(rows)],
                          512, "error")  # (what the runs trained on)
    batch = pad_sequences([e.prompt for e in examples], [e.completions[0] for e in examples],
                          tok.pad_token_id)
    with torch.no_grad():
        scale = logprob_scale(model(input_ids=batch["input_ids"],
                                    attention_mask=batch["attention_mask"]).logits)
    # the loss is a mean of per-token log-probs, each of which the two layouts compute
    # within pair_bound · scale (as above): so is the mean
    cfg = model.config
    bound = pair_bound(model_stages(cfg, False) + 2, model_inner(cfg, 64)) * scale
    assert abs(losses[0] - losses[1]) <= bound


def test_packing_keys_are_checked(tmp_path):
    from posttrain.config import ConfigError, RLConfig, SFTConfig

    cfg = SFTConfig(output_dir=str(tmp_path), packing=False, max_tokens_per_micro_batch=64)
    cfg.given = {"packing", "max_tokens_per_micro_batch"}
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        cfg.validate()
    cfg = SFTConfig(output_dir=str(tmp_path), max_tokens_per_micro_batch=64)
    cfg.given = {"max_tokens_per_micro_batch"}
    cfg.validate()  # (automatic packing: the budget caps its rows if it packs)
    cfg = RLConfig(output_dir=str(tmp_path), packing=False, max_tokens_per_micro_batch=64)
    cfg.given = {"packing", "max_tokens_per_micro_batch"}
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        cfg.validate()
    cfg = SFTConfig(output_dir=str(tmp_path), packing=True, max_tokens_per_micro_batch=0)
    with pytest.raises(ConfigError, match="must be ≥ 1"):
        cfg.validate()


PAIRS = 3  # PROMPTS[:3] with chosen COMPLETIONS[:3] and rejected COMPLETIONS[1:4]


def _pair_layouts(budget):
    from posttrain.trainers.offline import _pair_batch

    class Example:
        def __init__(self, i):
            self.prompt, self.completions = PROMPTS[i], (COMPLETIONS[i], COMPLETIONS[i + 1])

    examples = [Example(i) for i in range(PAIRS)]
    return _pair_batch(examples, 0), _pair_batch(examples, 0, packing=True, budget=budget)


@pytest.mark.parametrize("budget", [None, 16])
def test_dpo_sequence_log_likelihoods_packed_as_padded(tiny_model_dir, budget):
    """A pair's chosen and rejected in one row; each sequence's summed log-likelihood (and
    its completion length) read back in the padded order, values and gradients within the
    derived bound of two float32 forwards (a sum of up to ``longest`` token terms)."""
    from posttrain.models import load_causal_lm
    from posttrain.trainers.offline import DPOTrainer

    model = load_causal_lm(tiny_model_dir, device="cpu")
    padded, packed = _pair_layouts(budget)
    assert packed["sequence_ids"][:, 0].tolist()[:1] == [0]  # (chosen 0 first, then its pair)
    for row in range(packed["input_ids"].shape[0]):  # no pair split across rows
        seqs = set(packed["sequence_ids"][row].tolist()) - {-1}
        assert all((i + PAIRS if i < PAIRS else i - PAIRS) in seqs for i in seqs)
    params = list(model.parameters())
    out = []
    for batch in (padded, packed):
        model.zero_grad()
        seq = DPOTrainer._sequence_logps(model, batch)
        (seq * torch.arange(1, 2 * PAIRS + 1)).sum().backward()  # (each sequence its weight)
        out.append((seq.detach(), [p.grad.clone() for p in params],
                    DPOTrainer._lengths(batch)))
    (a, ga, la), (b, gb, lb) = out
    assert torch.equal(la, lb)
    cfg, tokens = model.config, padded["input_ids"].numel()
    with torch.no_grad():
        scale = logprob_scale(model(input_ids=padded["input_ids"],
                                    attention_mask=padded["attention_mask"]).logits)
    longest = int(la.max())
    assert_within(b, a, pair_bound(model_stages(cfg, False) + 2, model_inner(cfg, tokens)),
                  longest * scale, "sequence log-likelihoods")
    # a gradient's terms: each token's log-prob gradient times its sequence's weight
    bound = pair_bound(model_stages(cfg) + 2, model_inner(cfg, tokens))
    model.zero_grad()
    lp = completion_logprobs(model, padded["input_ids"], padded["attention_mask"],
                             padded["loss_mask"]) * torch.arange(1, 2 * PAIRS + 1)[:, None]
    scales = grad_term_scales(lp[lp != 0], params)
    for (name, _), x, y, s in zip(model.named_parameters(), ga, gb, scales, strict=True):
        assert_within(y, x, bound, s, name)


def test_reward_scores_packed_as_padded(tiny_model_dir):
    """A reward model's score of each sequence, read at its last token of its packed row,
    equals the padded one's within two float32 forwards' bound: the backbone's stages and
    the head's dot product (+1), times the head's terms ``Σ|w_i h_i|``."""
    from posttrain.models import load_tokenizer
    from posttrain.models.loading import load_reward_model
    from posttrain.models.logprobs import backbone, sequence_scores

    model = load_reward_model(tiny_model_dir, load_tokenizer(tiny_model_dir))
    padded, packed = _pair_layouts(None)
    a = sequence_scores(model, padded["input_ids"], padded["attention_mask"])
    b = sequence_scores(model, packed["input_ids"], None, packed["position_ids"],
                        packed["ends"])
    with torch.no_grad():
        hidden = backbone(model)(input_ids=padded["input_ids"],
                                 attention_mask=padded["attention_mask"]).last_hidden_state
        last = padded["attention_mask"].sum(-1) - 1
        h = hidden[torch.arange(len(last)), last]
        terms = (h.abs() @ model.score.weight.abs().T).squeeze(-1)
    cfg = model.config
    assert_within(b.detach(), a.detach(),
                  pair_bound(model_stages(cfg, False) + 1,
                             model_inner(cfg, padded["input_ids"].numel())),
                  terms, "scores")


@pytest.mark.parametrize("command", ["rm", "dpo"])
def test_rm_and_dpo_train_packed(tiny_model_dir, tmp_path, command):
    from posttrain.cli import main

    rows = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)}
            for a in range(6)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([command, "--model", tiny_model_dir, "--data", str(tmp_path / "p.jsonl"),
                 "--batch_size", "3", "--max_steps", "2", "--device", "cpu", "--tensorboard",
                 "false", "--packing", "true", "--max_tokens_per_micro_batch", "32",
                 "--output_dir", str(tmp_path / "run")]) == 0


@pytest.mark.parametrize("budget", [None, 12])
def test_rl_token_batches_packed_as_padded(tiny_model_dir, budget):
    """An RL step's token batch (full sequences, ``share_prompt`` off): the log-probs and
    entropies of any subset of its rows, and a critic's values, packed as padded, within
    two float32 forwards' bound (the critic's: its backbone and the value head's dot
    product, times its terms ``Σ|w_i h_i|``)."""
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.models.loading import load_reward_model
    from posttrain.models.logprobs import backbone
    from posttrain.rollout import Rollout
    from posttrain.trainers.online import TokenBatch

    model = load_causal_lm(tiny_model_dir, device="cpu")
    Lc = max(map(len, COMPLETIONS))
    ids = torch.tensor([c + [0] * (Lc - len(c)) for c in COMPLETIONS])
    mask = (torch.arange(Lc) < torch.tensor([len(c) for c in COMPLETIONS])[:, None]).long()
    rollout = Rollout(prompt_ids=PROMPTS, completion_ids=ids, completion_mask=mask,
                      logprobs=torch.zeros(ids.shape), truncated=torch.zeros(4, dtype=bool),
                      group_ids=torch.arange(4), texts=[""] * 4)
    padded = TokenBatch(rollout, 0, "cpu", False, 0.7)
    packed = TokenBatch(rollout, 0, "cpu", False, 0.7, packing=True, budget=budget)
    cfg, tokens = model.config, padded.full["input_ids"].numel()
    with torch.no_grad():
        scale = logprob_scale(model(input_ids=padded.full["input_ids"],
                                    attention_mask=padded.full["attention_mask"]).logits / 0.7)
        for rows in (torch.arange(4), torch.tensor([3, 1])):
            (a, ea), (b, eb) = (t.logprobs(model, rows, with_entropy=True)
                                for t in (padded, packed))
            bound = pair_bound(model_stages(cfg, False) + 2, model_inner(cfg, tokens))
            assert_within(b, a, bound, scale, "log-probs")
            assert_within(eb, ea, bound, scale, "entropies")  # (each term ≤ scale too)
            assert (a[mask[rows] == 0] == 0).all() and (b[mask[rows] == 0] == 0).all()
        critic = load_reward_model(tiny_model_dir, load_tokenizer(tiny_model_dir))
        rows = torch.arange(4)
        a, b = padded.values(critic, rows), packed.values(critic, rows)
        hidden = backbone(critic)(input_ids=padded.full["input_ids"],
                                  attention_mask=padded.full["attention_mask"]
                                  ).last_hidden_state
        terms = (hidden.abs() @ critic.score.weight.abs().T).amax()
        assert_within(b, a, pair_bound(model_stages(cfg, False) + 1, model_inner(cfg, tokens)),
                      float(terms), "values")


@pytest.mark.parametrize("command", [["grpo"], ["ppo"], ["grpo", "--env", "builtin"]])
def test_rl_runs_train_packed(command, tmp_path):
    """``--packing true`` on the RL trainers (and episodes): the run completes, sampling and
    scoring as ever."""
    from posttrain.cli import main

    out = tmp_path / "run"
    assert main([*command, "--packing", "true", "--max_tokens_per_micro_batch", "64",
                 "--max_steps", "2", "--prompts_per_step", "4", "--group_size", "2",
                 "--builtin_train_size", "16", "--builtin_eval_size", "4", "--eval_every", "0",
                 "--device", "cpu", "--tensorboard", "false", "--output_dir", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in rows if "train/loss" in r) == 2


def test_shares_balanced_by_tokens(monkeypatch):
    """Each rank's share of a micro-batch by cost: the costliest first to the least loaded
    rank; every item exactly once over the ranks, loads within the largest item of each
    other, none empty, the same assignment on every rank."""
    from posttrain import dist

    costs = [3, 120, 5, 7, 64, 9, 1, 30]
    items = list(range(len(costs)))
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    shares = []
    for r in (0, 1):
        monkeypatch.setattr(dist, "rank", lambda r=r: r)
        shares.append(dist.shard_by_cost(items, costs))
    assert sorted(shares[0] + shares[1]) == items and all(shares)
    loads = [sum(costs[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= max(costs)
    assert shares[0] == sorted(shares[0])  # (in their order)
    assert shares[0] == [1] and loads == [120, 119]  # (by hand: 120 alone outweighs the rest)


def test_automatic_packing_reads_the_padding_it_would_save():
    """Left automatic, packing is on exactly when the packed micro-batches run at most
    PACK_BELOW of the padded tokens, rows capped at the data's longest group; a setting
    given is kept as it is."""
    from posttrain.packing import PACK_BELOW, decide_packing, layout_tokens

    assert layout_tokens([[10], [5], [3]], 10) == (30, 20)  # rows [10], [5, 3]
    assert layout_tokens([[10], [5], [3]], None) == (30, 18)  # one row
    assert layout_tokens([[4, 6], [2, 2]], 8) == (24, 20)  # a pair stays in one row
    uniform = [[[9], [10], [9], [10]]] * 4
    assert decide_packing(None, None, uniform, 10) == (False, 10)
    tailed = [[[40], [6], [5], [7]]] * 4  # padded 4·40 = 160, packed 2 rows · 40 = 80
    assert decide_packing(None, None, tailed, 40) == (True, 40)
    assert decide_packing(None, 64, tailed, 40) == (True, 64)  # one row of 58
    assert decide_packing(False, None, tailed, 40) == (False, None)
    assert decide_packing(True, None, uniform, 10) == (True, None)
    assert decide_packing(None, None, [], 0) == (False, None)
    # at the threshold itself: packed = PACK_BELOW · padded packs; a little more does not
    edge = [[[2], [1], [1], *[[2]] * 7]]  # padded 10·2 = 20, packed 9 rows of 2: 18
    assert layout_tokens(edge[0], 2) == (20, 18) and PACK_BELOW == 18 / 20
    assert decide_packing(None, None, edge, 2)[0]
    assert not decide_packing(None, None, [*edge, [[1], [1]]], 2)[0]  # + (2, 2): 20 / 22


@pytest.mark.parametrize("extra, packs", [([], True), (["--packing", "false"], False),
                                          (["--max_tokens_per_micro_batch", "200"], True)])
def test_sft_packs_a_long_tailed_dataset_by_itself(tiny_model_dir, tmp_path, capsys, extra,
                                                   packs):
    """sft with packing left automatic on lengths 4 to ~60 tokens: it packs, says so in one
    line with its row budget, and trains; ``--packing false`` keeps it padded."""
    from posttrain.cli import main

    rows = [{"prompt": "1+1=" if i % 4 else "Add these numbers with care, please: 1+1=",
             "completion": "2"} for i in range(8)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert main(["sft", "--model", tiny_model_dir, "--data", str(tmp_path / "d.jsonl"),
                 "--batch_size", "4", "--max_steps", "2", "--log_every", "1", "--device",
                 "cpu", "--tensorboard", "false", "--output_dir", str(out), *extra]) == 0
    said = [x for x in capsys.readouterr().err.splitlines() if "packing: on" in x]
    assert len(said) == int(packs)
    if packs:
        from posttrain.data import encode_sft
        from posttrain.models import load_tokenizer

        examples = encode_sft(load_tokenizer(tiny_model_dir), "d.jsonl",
                              [{**r, "_row": i + 1} for i, r in enumerate(rows)], 512, "error")
        longest = max(len(e.prompt) + len(e.completions[0]) for e in examples)
        assert said[0].endswith("rows of up to 200 tokens, one forward each" if extra
                                else f"rows of up to {longest} tokens"), said
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
             if '"train/loss"' in x]
    assert len(steps) == 2 and all(math.isfinite(s["train/loss"]) for s in steps)


@pytest.mark.parametrize(("command", "extra", "said"), [
    ("rm", [], "packing: on (automatic"),
    ("dpo", [], None),  # (its shared-prompt layout, automatic too, is kept)
    ("dpo", ["--max_tokens_per_micro_batch", "64"], "packing: off (automatic: another layout"),
    ("dpo", ["--share_prompt", "false"], "packing: on (automatic")])
def test_pairs_pack_by_themselves_where_padding_dominates(tiny_model_dir, tmp_path, capsys,
                                                          command, extra, said):
    """rm decides as sft does, a pair counted as one group of two sequences; dpo too, unless
    its prompts are shared (automatic: wherever that pays, as on the tiny model), and an
    unused budget is said."""
    from posttrain.cli import main

    rows = [{"prompt": "1+1=" if i % 4 else "Add these numbers with care, please: 1+1=",
             "chosen": "2", "rejected": "3"} for i in range(8)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([command, "--model", tiny_model_dir, "--data", str(tmp_path / "p.jsonl"),
                 "--batch_size", "4", "--max_steps", "1", "--device", "cpu", "--tensorboard",
                 "false", "--output_dir", str(tmp_path / "run"), *extra]) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if "packing:" in x]
    assert err == ([] if said is None else [err[0]]) and (said is None or said in err[0]), err


def _rollout(completion_lengths):
    from posttrain.rollout import Rollout

    n, Lc = len(completion_lengths), max(completion_lengths)
    ids = torch.tensor([[7] * k + [0] * (Lc - k) for k in completion_lengths])
    mask = (torch.arange(Lc) < torch.tensor(completion_lengths)[:, None]).long()
    return Rollout(prompt_ids=[[5, 6, 7]] * n, completion_ids=ids, completion_mask=mask,
                   logprobs=torch.zeros(ids.shape), truncated=torch.zeros(n, dtype=bool),
                   group_ids=torch.arange(n), texts=[""] * n)


def test_rl_token_batches_pack_by_themselves_where_padding_dominates():
    """Left unset, an RL step's full-sequence batch packs when packed it would run at most
    PACK_BELOW of its padded tokens, rows capped at its longest sequence; a shared-prompt
    batch, or one told not to, stays as it is."""
    from posttrain.trainers.online import TokenBatch

    tailed = TokenBatch(_rollout([1, 1, 1, 20]), 0, "cpu", False, 1.0, packing=None)
    assert (tailed.packing, tailed.budget) == (True, 23)  # 92 padded, 2 rows · 23 = 46
    even = TokenBatch(_rollout([5, 5, 5, 6]), 0, "cpu", False, 1.0, packing=None)
    assert (even.packing, even.budget) == (False, 9)  # 4 rows of 9 either way
    told = TokenBatch(_rollout([1, 1, 1, 20]), 0, "cpu", False, 1.0, packing=False)
    assert (told.packing, told.budget) == (False, None)
    shared = TokenBatch(_rollout([1, 1, 1, 20]), 0, "cpu", True, 1.0, packing=None)
    assert shared.packing is False
    rows = torch.arange(4)
    assert tailed._pack(rows)[0]["input_ids"].shape == (2, 23)


def test_automatic_packing_resumes_exactly(tiny_model_dir, tmp_path, capsys):
    """A resumed run decides packing as the run it continues (the data, seed and batch
    size decide it): a long-tailed sft run rebuilt from its step-2 checkpoint ends on the
    uninterrupted run's weights, bit for bit."""
    from safetensors.torch import load_file

    from posttrain.cli import main

    rows = [{"prompt": "1+1=" if i % 4 else "Add these numbers with care, please: 1+1=",
             "completion": "2"} for i in range(8)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(out, steps, *extra):
        assert main(["sft", "--model", tiny_model_dir, "--data", str(tmp_path / "d.jsonl"),
                     "--batch_size", "4", "--max_steps", str(steps), "--save_every", "2",
                     "--lr_schedule", "constant", "--warmup_ratio", "0", "--device", "cpu",
                     "--tensorboard", "false", "--output_dir", str(out), *extra]) == 0

    run(tmp_path / "whole", 4)
    run(tmp_path / "cut", 4, "--resume_from", str(tmp_path / "whole" / "checkpoint-2"))
    assert capsys.readouterr().err.count("packing: on (automatic") == 2
    a, b = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _record_backbone_calls(monkeypatch, packed_only: bool = False) -> list[tuple[bool, tuple]]:
    """Every call of the Llama backbone from now on: (gradient on, input shape); with
    ``packed_only`` the calls on packed rows alone (positions given, no attention mask: not
    the sampler's or the evaluation's padded prompts)."""
    from transformers.models.llama import modeling_llama

    calls: list[tuple[bool, tuple]] = []
    forward = modeling_llama.LlamaModel.forward

    def recording(self, input_ids=None, *args, **kwargs):
        packed = (kwargs.get("position_ids") is not None
                  and kwargs.get("attention_mask") is None)
        if input_ids is not None and (packed or not packed_only):
            calls.append((torch.is_grad_enabled(), tuple(input_ids.shape)))
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", recording)
    return calls


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_a_token_budget_bounds_every_offline_forward(tiny_model_dir, tmp_path, monkeypatch,
                                                     command):
    """``--packing true --max_tokens_per_micro_batch N``: the step's examples (all 8 of the
    data: one epoch) run in forwards of one packed row of at most N tokens each, as many as
    next-fit over the step's examples needs (more than ``grad_accum``: cut by tokens, not
    by count), every example's tokens exactly once; DPO's reference pass alike."""
    from posttrain.cli import main
    from posttrain.data import encode_pairs, encode_sft, packed_rows
    from posttrain.models import load_tokenizer

    budget = 40
    if command == "sft":
        rows = [{"prompt": f"{a * 37 % 1000}+{a}" + "1" * (a % 4 * 3) + "=",
                 "completion": str(a * 38 % 1000)} for a in range(8)]
    else:
        rows = [{"prompt": f"{a}+{a}" + "0" * (a % 3 * 2) + "=", "chosen": str(2 * a),
                 "rejected": str(2 * a + 1) * (1 + a % 2)} for a in range(8)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(tiny_model_dir)
    encode = encode_sft if command == "sft" else encode_pairs
    examples = encode(tok, "d.jsonl", [{**r, "_row": i + 1} for i, r in enumerate(rows)], 512,
                      "error")
    sizes = [sum(len(e.prompt) + len(c) for c in e.completions) for e in examples]
    assert max(sizes) <= budget < sum(sizes) / 2  # (each fits; a step needs several)
    calls = _record_backbone_calls(monkeypatch)
    assert main([command, "--model", tiny_model_dir, "--data", str(tmp_path / "d.jsonl"),
                 "--batch_size", "4", "--grad_accum", "2", "--max_steps", "1", "--device",
                 "cpu", "--tensorboard", "false", "--packing", "true",
                 "--max_tokens_per_micro_batch", str(budget),
                 "--output_dir", str(tmp_path / "run")]) == 0
    trained = [shape for grad, shape in calls if grad]
    assert all(rows_ == 1 and n <= budget for rows_, n in trained), trained
    assert sum(n for _, n in trained) == sum(sizes)  # every example once, no padding
    assert len(trained) >= len(packed_rows(sorted(sizes), budget)) > 2  # (> grad_accum)
    # dpo: the reference's log-likelihoods, computed once over the data (precompute_ref),
    # in forwards of the same bound
    reference = [shape for grad, shape in calls if not grad]
    assert all(rows_ == 1 and n <= budget for rows_, n in reference), reference
    assert sum(n for _, n in reference) == (sum(sizes) if command == "dpo" else 0)


def test_a_token_budget_bounds_every_rl_forward(tmp_path, monkeypatch):
    """The RL trainers: with a budget every forward of the update and of the old and
    reference passes (a KL term, several minibatches) is one packed row of at most N
    tokens, where the step's samples would exceed it."""
    from posttrain.cli import main

    budget = 48
    calls = _record_backbone_calls(monkeypatch, packed_only=True)
    out = tmp_path / "run"
    assert main(["grpo", "--share_prompt", "false", "--packing", "true",
                 "--max_tokens_per_micro_batch", str(budget), "--kl_coef", "0.05",
                 "--max_steps", "1", "--prompts_per_step", "4", "--group_size", "4",
                 "--minibatch_size", "8", "--builtin_train_size", "16",
                 "--builtin_eval_size", "4", "--eval_every", "0", "--device", "cpu",
                 "--tensorboard", "false", "--output_dir", str(out)]) == 0
    trained = [shape for grad, shape in calls if grad]
    scored = [shape for grad, shape in calls if not grad]
    assert all(rows == 1 and n <= budget for rows, n in trained + scored), calls
    assert sum(n for _, n in trained) > 2 * budget  # (the step alone would not fit)
    # the old and the reference pass (2 minibatches: the update is not on-policy) each run
    # the step's sequences once, in the same bound
    assert sum(n for _, n in scored) == 2 * sum(n for _, n in trained)
