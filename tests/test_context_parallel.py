"""Context parallelism (``--context_parallel``): a sequence split over 2 gloo ranks gives the
log-probs, entropies, hidden states, scores and gradients of the whole sequence in one
process (float64, every layout: whole rows, an odd length, right and left padding, packed
rows; multi-head, grouped and single key-value heads); the runs that cannot be split are
refused in one line. The trainers' 2-rank runs are in tests/test_distributed.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import procs
from posttrain import dist
from posttrain.config import ConfigError
from posttrain.models import context_parallel

WORKER = Path(__file__).with_name("context_parallel_worker.py")

# The split and the whole computation differ only in the order of float64 sums: SDPA's
# blocking over a stretch instead of the row, and a gradient summed over 2 ranks instead of
# accumulated in one. A sum of m terms is off by at most m·eps relative to the sum of the
# magnitudes; the longest chains here (vocabulary 61, MLP 48, 2 layers forward and backward,
# 13 columns) stay far below 4096 terms, so 4096·eps of the largest magnitude bounds every
# difference. A wrong split (a missing exchange, attention past a sequence's end, a gradient
# counted twice) is off by ~1e-2 or more.
TOLERANCE = 4096 * torch.finfo(torch.float64).eps


@pytest.mark.multiprocess
def test_a_split_sequence_computes_what_the_whole_one_does(tmp_path):
    out = tmp_path / "report.json"
    proc = procs.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                      "2", "--standalone", str(WORKER), str(out)],
                     env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report) == 15  # 3 head layouts × 5 batch layouts
    for case, res in report.items():
        assert res.pop("grad_keys"), case
        for what, (diff, scale) in res.items():
            assert scale > 0, (case, what)
            assert diff <= TOLERANCE * max(scale, 1.0), (case, what, diff, scale)


def test_a_model_whose_heads_do_not_split_is_refused(monkeypatch):
    from types import SimpleNamespace

    from transformers import LlamaConfig

    cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=4, hidden_size=32)
    monkeypatch.setitem(dist._CONTEXT, "size", 3)
    with pytest.raises(ConfigError, match="4 attention heads do not split over 3 ranks"):
        context_parallel.enable(SimpleNamespace(config=cfg))
    monkeypatch.setitem(dist._CONTEXT, "size", 2)
    assert context_parallel.unsupported(cfg) is None
    cfg.layer_types = ["sliding_attention", "full_attention"]
    assert "full causal attention only" in context_parallel.unsupported(cfg)
    from transformers import MistralConfig, Qwen2Config

    mistral = MistralConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    assert mistral.sliding_window  # (its default: a window, with no use_sliding_window key)
    assert "full causal attention only" in context_parallel.unsupported(mistral)
    mistral.sliding_window = None
    assert context_parallel.unsupported(mistral) is None
    qwen = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    assert qwen.use_sliding_window is False  # a window given but not used: full attention
    assert context_parallel.unsupported(qwen) is None


def test_context_parallel_must_divide_the_ranks():
    with pytest.raises(ConfigError, match="context_parallel 2 must divide the 1 ranks"):
        dist.set_context(2)
    assert dist.context_size() == 1


def test_context_parallel_is_refused_with_a_shared_prompt():
    from posttrain.config import DPOConfig

    cfg = DPOConfig(context_parallel=2, share_prompt=True)
    with pytest.raises(ConfigError, match="leave share_prompt off"):
        cfg.validate()


def test_a_context_group_holds_one_data_share(monkeypatch):
    """World 4, k = 2: ranks 0, 1 are data replica 0 and ranks 2, 3 replica 1; a group's
    ranks take the same share (by count and by tokens), and a value both hold is summed
    once per group."""
    costs = [3, 120, 5, 7, 64, 9, 1, 30]
    items = list(range(len(costs)))
    monkeypatch.setattr(dist, "world_size", lambda: 4)
    monkeypatch.setitem(dist._CONTEXT, "size", 2)
    sent = []
    monkeypatch.setattr(dist, "sum_floats", lambda values: sent.append(values) or values)
    shares = []
    for r in range(4):
        monkeypatch.setattr(dist, "rank", lambda r=r: r)
        shares.append((dist.data_rank(), dist.shard(items), dist.shard_by_cost(items, costs)))
        dist.data_sum([10.0 * (r // 2 + 1)])  # replica 0 holds 10, replica 1 holds 20
    assert shares[0] == shares[1] and shares[2] == shares[3]
    assert [s[0] for s in shares] == [0, 0, 1, 1]
    assert shares[0][1] == [0, 2, 4, 6] and sorted(shares[0][2] + shares[2][2]) == items
    assert sum(v[0] for v in sent) == 30.0  # (each group's first rank speaks for it)


def test_the_rl_rows_are_dealt_by_tokens(monkeypatch):
    """Sharded, context-parallel, or under ddp on full sequences, the step's rows are dealt
    to data-parallel ranks by tokens (prompt + completion), not by count: one long episode
    weighs as much as the seven short rows together. Under ddp a shared-prompt step, or an
    MoE policy's, keeps the rows each rank sampled."""
    from types import SimpleNamespace

    from posttrain.trainers.online.trainer import RLTrainer

    prompts = [[1] * 4] * 8
    lengths = [2, 3, 2, 60, 3, 2, 2, 3]
    completion_mask = torch.zeros(8, 64)
    for i, n in enumerate(lengths):
        completion_mask[i, :n] = 1
    exp = SimpleNamespace(rollout=SimpleNamespace(prompt_ids=prompts,
                                                  completion_mask=completion_mask))
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    exp.local, exp.own = "sampled here", torch.tensor([0, 2, 4, 6])  # (rank 0's draw)
    for sharded, share, moe, dealt in ((True, True, False, True), (False, False, False, True),
                                       (False, True, False, False), (False, False, True, False)):
        got = []
        for r in (0, 1):
            monkeypatch.setattr(dist, "rank", lambda r=r: r)
            trainer = SimpleNamespace(sharded=sharded, moe=moe)
            got.append(RLTrainer._mine(trainer, exp, share)[1].tolist())
            assert trainer.dealt == dealt
        if dealt:  # (fsdp; or ddp on full sequences, not MoE)
            assert got == [[3], [0, 1, 2, 4, 5, 6, 7]]  # 64 tokens against 7 rows of 45
        else:  # ddp in the shared-prompt layout, or MoE: the rows each rank sampled
            assert got == [[0, 2, 4, 6]] * 2
