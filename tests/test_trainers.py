"""End-to-end runs of the offline trainers on a random tiny model (seconds, CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from bounds import model_inner, model_stages, rel_bound
from posttrain import config
from posttrain.core.preference import DPO_LOSS_TYPES
from posttrain.data import DataError
from posttrain.trainers.offline import (
    DPOConfig,
    RMConfig,
    SFTConfig,
    SFTTrainer,
    run_dpo,
    run_rm,
    run_sft,
)

SMALL = dict(builtin_train_size=64, builtin_eval_size=16, batch_size=4, grad_accum=2,
             max_steps=3, log_every=1, device="cpu", tensorboard=False)


def make(cls, model_dir, out: Path, **kw):
    cfg = cls(model=model_dir, output_dir=str(out), **{**SMALL, **kw})
    cfg.validate()
    return cfg


def read_metrics(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def train_records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out) if "train/loss" in r}


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


RUNS = [(SFTConfig, run_sft, AutoModelForCausalLM, ("train/loss",)),
        (RMConfig, run_rm, AutoModelForSequenceClassification, ("train/loss", "train/accuracy")),
        (DPOConfig, run_dpo, AutoModelForCausalLM, ("train/loss", "train/reward_accuracy"))]


@pytest.mark.parametrize("cls,run,auto,keys", RUNS, ids=["sft", "rm", "dpo"])
def test_end_to_end(tiny_model_dir, tmp_path, cls, run, auto, keys):
    out = tmp_path / "run"
    cfg = make(cls, tiny_model_dir, out, save_every=2)
    result = run(cfg)

    records = read_metrics(out)
    assert all(isinstance(r, dict) and isinstance(r["step"], int) for r in records)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        for k in (*keys, "train/lr", "train/grad_norm"):
            assert math.isfinite(r[k]), k
    evals = [r for r in records if "eval/loss" in r]
    assert len(evals) == 1 and evals[0]["step"] == 3  # held-out split evaluated at the end
    assert result["eval/loss"] == evals[0]["eval/loss"]
    assert result["train/loss"] == train[-1]["train/loss"]

    assert config.load(cls, str(out / "config.yaml")) == cfg

    assert (out / "checkpoint-2" / "model.safetensors").exists()
    assert not (out / "checkpoint-3").exists()  # the last step is final/, not a checkpoint
    assert not (out / "checkpoint-1").exists()

    final = out / "final"
    assert (final / "model.safetensors").exists()
    model = auto.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert tok("7+8=")["input_ids"] == [3 + b for b in b"7+8="]
    # training moved the weights away from the starting model
    start = weights(Path(tiny_model_dir))
    moved = {k: v for k, v in model.state_dict().items() if k in start}
    assert moved and any(not torch.equal(v, start[k]) for k, v in moved.items())
    # the checkpoint is an earlier state than final
    ckpt = weights(out / "checkpoint-2")
    final_w = weights(final)
    assert any(not torch.equal(ckpt[k], final_w[k]) for k in final_w)


def test_lr_schedule_logged(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run_sft(make(SFTConfig, tiny_model_dir, out, max_steps=4, lr=1e-3, warmup_ratio=0.5,
                 lr_schedule="linear"))
    lrs = [train_records(out)[s]["train/lr"] for s in (1, 2, 3, 4)]
    # the rate each step used: warm-up over 2 steps, then linear to 0
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])


def test_rm_reproducible_with_seed(tiny_model_dir, tmp_path):
    torch.manual_seed(123)  # the global generator state must not matter
    a = run_rm(make(RMConfig, tiny_model_dir, tmp_path / "a", max_steps=2))
    torch.manual_seed(456)
    b = run_rm(make(RMConfig, tiny_model_dir, tmp_path / "b", max_steps=2))
    assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
        {k: v for k, v in b.items() if not k.startswith("time/")}
    wa, wb = weights(tmp_path / "a" / "final"), weights(tmp_path / "b" / "final")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_dpo_precompute_ref_matches_live_reference(tiny_model_dir, tmp_path):
    kw = dict(lr=1e-3, warmup_ratio=0.0, max_steps=3)
    run_dpo(make(DPOConfig, tiny_model_dir, tmp_path / "pre", precompute_ref=True, **kw))
    run_dpo(make(DPOConfig, tiny_model_dir, tmp_path / "live", precompute_ref=False, **kw))
    pre, live = train_records(tmp_path / "pre"), train_records(tmp_path / "live")
    # step 1: reference = starting model, so z = 0 and the loss is log 2
    assert pre[1]["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert live[1]["train/loss"] == pytest.approx(pre[1]["train/loss"], abs=1e-6)
    # later steps: the policy has moved; both runs still measure it against the same reference
    assert abs(pre[3]["train/reward_margin"]) > 1e-4
    for step in (1, 2, 3):
        for k in ("train/loss", "train/chosen_reward", "train/rejected_reward",
                  "train/reward_margin", "train/grad_norm"):
            assert live[step][k] == pytest.approx(pre[step][k], rel=1e-3, abs=1e-6), (step, k)


# first-step loss with z = 0 (policy = reference), β = 0.1, ε = 0.1
FIRST_LOSS = {"sigmoid": math.log(2), "robust": math.log(2), "ipo": (1 / (2 * 0.1)) ** 2,
              "hinge": 1.0}


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_loss_types(tiny_model_dir, tmp_path, loss_type):
    out = tmp_path / "run"
    result = run_dpo(make(DPOConfig, tiny_model_dir, out, loss_type=loss_type, beta=0.1,
                          label_smoothing=0.1, max_steps=2, builtin_eval_size=8))
    rec = train_records(out)
    assert rec[1]["train/loss"] == pytest.approx(FIRST_LOSS[loss_type], rel=1e-4)
    assert math.isfinite(rec[2]["train/loss"]) and math.isfinite(result["eval/loss"])


def test_sft_overfits_tiny_jsonl(tiny_model_dir, tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)}
            for a, b in [(1, 2), (3, 4), (10, 20), (7, 7), (15, 6), (2, 9), (40, 2), (8, 8)]]
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    run_sft(make(SFTConfig, tiny_model_dir, out, data=str(path), lr=1e-2, max_steps=20,
                 batch_size=8, grad_accum=1, warmup_ratio=0.0, lr_schedule="constant"))
    losses = [r["train/loss"] for _, r in sorted(train_records(out).items())]
    assert len(losses) == 20
    assert losses[0] > 4.0  # random init over 259 tokens: about log(259) = 5.6
    assert losses[-1] < 0.5 * losses[0]
    assert min(losses[-5:]) < min(losses[:5])
    assert not (out / "metrics.jsonl").read_text().count("eval/")  # no eval_data given


def test_sft_eval_data_file(tiny_model_dir, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    result = run_sft(make(SFTConfig, tiny_model_dir, tmp_path / "run", data=str(path),
                          eval_data=str(path), max_steps=1, batch_size=2, grad_accum=1))
    assert math.isfinite(result["eval/loss"])


def test_sft_all_rows_dropped_is_an_error(tiny_model_dir, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2222222222"}) + "\n")
    cfg = make(SFTConfig, tiny_model_dir, tmp_path / "run", data=str(path), max_length=6,
               overlong="drop")
    with pytest.raises(DataError, match="no rows left"):
        run_sft(cfg)


def test_sft_bad_data_fails_before_training(tiny_model_dir, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": 2}) + "\n")
    out = tmp_path / "run"
    with pytest.raises(DataError) as e:
        run_sft(make(SFTConfig, tiny_model_dir, out, data=str(path)))
    assert (e.value.row, e.value.field) == (1, "completion")
    assert not out.exists()


def test_grad_accum_invariance(tiny_model_dir, tmp_path):
    """One step over the same 8 examples: one micro-batch of 8 or two of 4."""
    kw = dict(max_steps=1, warmup_ratio=0.0, max_grad_norm=0.0, lr=1e-3, builtin_eval_size=1)
    run_sft(make(SFTConfig, tiny_model_dir, tmp_path / "a", batch_size=8, grad_accum=1, **kw))
    run_sft(make(SFTConfig, tiny_model_dir, tmp_path / "b", batch_size=4, grad_accum=2, **kw))
    run_sft(make(SFTConfig, tiny_model_dir, tmp_path / "c", batch_size=2, grad_accum=4, **kw))
    a, b, c = (train_records(tmp_path / x)[1] for x in "abc")
    # loss and gradient norm are normalised over the whole step's tokens
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    tol = 2 * rel_bound(model_stages(cfg), model_inner(cfg, 64))  # two float32 computations
    for x in (b, c):
        assert x["train/loss"] == pytest.approx(a["train/loss"], rel=tol)
        assert x["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=tol)
    # Weights are not compared: AdamW's first step is ≈ lr·sign(g), so a gradient entry
    # near zero whose rounding differs between the splits moves by a full lr. The test
    # below compares the parameters after a plain SGD step, which are -lr·g.


def test_grad_accum_changes_nothing_in_the_gradient(tiny_model_dir, tmp_path, monkeypatch):
    """With plain SGD the step is -lr·g, so equal parameters mean equal gradients."""
    from posttrain.builtin import task
    from posttrain.data import encode_sft, validate
    from posttrain.models import load_causal_lm, load_tokenizer

    monkeypatch.setattr(torch.optim, "AdamW",
                        lambda params, lr, weight_decay, **_: torch.optim.SGD(params, lr=lr))
    tok = load_tokenizer(tiny_model_dir)
    rows = validate("b", task.sft_rows(8, "train", seed=3), "sft")
    examples = encode_sft(tok, "b", rows, 64, "error")
    lengths = {len(e.completions[0]) for e in examples}
    assert len(lengths) > 1  # micro-batches hold different token counts
    params = []
    for bs, ga in ((8, 1), (4, 2), (1, 8)):
        cfg = SFTConfig(model=tiny_model_dir, output_dir=str(tmp_path / f"{bs}"), batch_size=bs,
                        grad_accum=ga, max_steps=1, warmup_ratio=0.0, max_grad_norm=0.0,
                        lr=1.0, device="cpu", tensorboard=False)
        model = load_causal_lm(tiny_model_dir, device="cpu")
        SFTTrainer(cfg, model, tok, examples, []).train()
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    start = torch.cat([p.flatten() for p in load_causal_lm(tiny_model_dir, device="cpu")
                       .parameters()]).detach()
    moved = params[0] - start  # = -g (lr 1)
    assert moved.abs().max() > 1e-3
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    tol = 2 * rel_bound(model_stages(cfg), model_inner(cfg, 64))  # two float32 computations
    for p in params[1:]:
        assert float((p - params[0]).norm() / moved.norm()) <= tol


def test_dpo_shared_prompt_matches_full_sequences(tiny_model_dir, tmp_path):
    """DPO with the prompt run once per pair logs the same losses as with two full
    sequences per pair (reference forward every step in both)."""
    import json

    from posttrain.trainers.offline import DPOConfig, run_dpo

    losses = {}
    for share in (True, False):
        cfg = DPOConfig(model=tiny_model_dir, output_dir=str(tmp_path / str(share)),
                        max_steps=3, batch_size=4, log_every=1, device="cpu", lr=1e-2,
                        builtin_train_size=32, builtin_eval_size=8, precompute_ref=False,
                        share_prompt=share, tensorboard=False, warmup_ratio=0.0)
        cfg.validate()
        run_dpo(cfg)
        rows = [json.loads(x) for x in (tmp_path / str(share) / "metrics.jsonl").read_text()
                .splitlines() if '"train/loss"' in x]
        losses[share] = [r["train/loss"] for r in rows]
    assert len(losses[True]) == 3
    for a, b in zip(losses[True], losses[False], strict=True):
        assert abs(a - b) < 1e-4, losses
    assert losses[True][0] != losses[True][2]  # the policy moved, so later steps test it
