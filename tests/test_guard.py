"""The weight-sync guard's bound (posttrain.rollout.guard), with stand-in engines whose
log-probs are the trainer's own plus a chosen error: the rounding floor for engines of the
trainer's precision, the measured start gap for a less precise one (bfloat16), and a stale
engine caught in both."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.rollout.guard import SyncGuard, SyncMismatch, dtype_bound, trainer_logprobs

PROMPTS = ["58+67=", "40+41="]


class _Engine:
    """Scores with ``model`` (its own copy of the weights), plus ``noise`` nats of a fixed
    ±pattern per token: a stand-in for another library's engine of lower precision."""

    name = "stand-in"

    def __init__(self, model, noise: float):
        self.model, self.noise = copy.deepcopy(model), noise

    def score(self, sequences, prompt_lens):
        out = trainer_logprobs(self.model, sequences, prompt_lens)
        return [x + self.noise * (1 - 2 * (torch.arange(len(x)) % 2)) for x in out]


@pytest.fixture(scope="module")
def probe():
    model = load_causal_lm("builtin", device="cpu").eval()
    tok = load_tokenizer("builtin")
    seqs = [tok(p + "99")["input_ids"] for p in PROMPTS]
    lens = [len(tok(p)["input_ids"]) for p in PROMPTS]
    return model, seqs, lens


def _stale(engine, model):
    """The trainer takes a step the engine never receives."""
    gen = torch.Generator().manual_seed(0)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return trained


def test_an_engine_of_the_trainers_precision_is_held_to_the_rounding_floor(probe):
    model, seqs, lens = probe
    engine = _Engine(model, 0.0)
    guard = SyncGuard(engine, model, seqs, lens, torch.float32, torch.float32)
    assert guard.tolerance == guard.floor  # no start gap beyond rounding
    assert guard.floor == dtype_bound(torch.float32, torch.float32, model.config, guard.scale0)
    assert guard.check(model, 1)["sync/gap_mean"] <= guard.floor
    with pytest.raises(SyncMismatch, match=r"step 2: .* differ from the trainer's by"):
        guard.check(_stale(engine, model), 2)


def test_a_bfloat16_engine_is_held_to_its_measured_start_gap_not_bf16s_worst_case(probe):
    """bfloat16's a-priori worst case is tens of nats per token on this model, which no
    stale sync reaches; the guard takes the rounding floor of the more precise side and
    32× the gap measured at the start (0.01 nats here), so a stale engine still stops it."""
    model, seqs, lens = probe
    engine = _Engine(model, 0.01)
    worst = dtype_bound(torch.bfloat16, torch.float32, model.config, 10.0)
    assert worst > 10  # what the old bound would have allowed
    guard = SyncGuard(engine, model, seqs, lens, torch.bfloat16, torch.float32)
    assert guard.floor == dtype_bound(torch.float32, torch.float32, model.config, guard.scale0)
    assert guard.baseline == pytest.approx(0.01, rel=1e-3)
    assert guard.tolerance == pytest.approx(0.32, rel=1e-3)
    assert guard.check(model, 1)["sync/gap_mean"] <= guard.tolerance
    with pytest.raises(SyncMismatch, match="step 3"):
        guard.check(_stale(engine, model), 3)


def test_the_bound_follows_the_logits(probe):
    """The rounding term scales with the logits' size: logits twice as large (a sharper
    policy) double what the check allows, as the bound's (1 + max|z|) says."""
    model, seqs, lens = probe
    engine = _Engine(model, 0.01)
    guard = SyncGuard(engine, model, seqs, lens, torch.bfloat16, torch.float32)
    sharper = copy.deepcopy(model)
    with torch.no_grad():
        sharper.lm_head.weight.mul_(2)  # tied: the embedding too; max|z| changes
    scale: list[float] = []
    trainer_logprobs(sharper, seqs, lens, scale)
    want = guard.tolerance * (1 + max(scale)) / (1 + guard.scale0)
    engine.model = sharper
    assert guard.check(sharper, 4)["sync/tolerance"] == pytest.approx(want)
