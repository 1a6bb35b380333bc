"""How a producer process and the learner share the cores (``async_cores``): the split, the
producer's wait flag, the learner's switch before each module forwards and backwards, and
whole runs with either mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.trainers.online.cores import Adaptive, Waiting, shares


class Flag:
    value = 0


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_split_gives_each_side_a_share_of_its_own():
    assert shares(1) == (1, 1)
    assert shares(2) == (1, 1)
    assert shares(3) == (1, 2)
    assert shares(16) == (8, 8)


def test_waiting_raises_the_flag_once_for_nested_waits():
    flag = Flag()
    waiting = Waiting(flag)
    with waiting():
        assert flag.value == 1
        with waiting():
            assert flag.value == 1
        assert flag.value == 1  # (the outer wait still holds)
    assert flag.value == 0
    with pytest.raises(KeyError), waiting():
        raise KeyError("x")
    assert flag.value == 0


class Probe(torch.nn.Module):
    """A leaf that notes the thread count its forward and its backward run with, and
    raises or lowers the flag as told, so that the next module sees the change."""

    def __init__(self, flag, forward_sets=None, backward_sets=None):
        super().__init__()
        self.flag, self.forward_sets, self.backward_sets = flag, forward_sets, backward_sets
        self.seen: list[tuple[str, int]] = []

    def forward(self, x):
        self.seen.append(("forward", torch.get_num_threads()))
        if self.forward_sets is not None:
            self.flag.value = self.forward_sets
        return _Note.apply(x, self)


class _Note(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probe):
        ctx.probe = probe
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        probe = ctx.probe
        probe.seen.append(("backward", torch.get_num_threads()))
        if probe.backward_sets is not None:
            probe.flag.value = probe.backward_sets
        return g, None


def test_the_learner_takes_every_core_while_the_flag_is_up(threads):
    """The count follows the flag module by module: forward, and backward (in reverse), and
    the time at every core is counted."""
    flag = Flag()
    a = Probe(flag, forward_sets=1, backward_sets=None)  # the producer starts to wait
    b = Probe(flag, forward_sets=None, backward_sets=0)  # it stops (seen in the backward)
    c = Probe(flag)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), a, torch.nn.Linear(4, 4), b,
                                torch.nn.Linear(4, 4), c)
    share = Adaptive(flag, own=1, all_cores=2)
    try:
        model(torch.randn(3, 4)).sum().backward()
        assert a.seen == [("forward", 1), ("backward", 1)]
        # forward: b and c run after a raised the flag; backward (c, then b): b lowered it,
        # and the module after b in the backward, a, ran on its own share again
        assert b.seen == [("forward", 2), ("backward", 2)]
        assert c.seen == [("forward", 2), ("backward", 2)]
        assert share.take_time() > 0
        assert share.take_time() == 0  # (counted once)
        with torch.no_grad():  # no backward hooks are made without grad
            flag.value = 1
            model(torch.randn(3, 4))
        assert c.seen[-1] == ("forward", 2)
    finally:
        share.close()
    assert torch.get_num_threads() == 1
    flag.value = 1
    model(torch.randn(3, 4))  # closed: the count stays put
    assert c.seen[-1] == ("forward", 1)


def test_a_step_marks_its_wait_for_the_environments(monkeypatch):
    """step_all waits for its workers' replies under env.waiting (the producer process's
    mark); one worker (the calls on this thread) marks nothing."""
    import contextlib

    from posttrain.builtin import episodes as builtin
    from posttrain.episodes import env as envs

    marks = []

    @contextlib.contextmanager
    def mark():
        marks.append("in")
        yield
        marks.append("out")

    monkeypatch.setattr(envs, "waiting", mark)
    spec = envs.EnvSpec(builtin.LookupEnv, {}, 30.0, "LookupEnv")
    rows = builtin.rows(4, "train", 0)
    episodes = [envs.Episode.of(spec, r, i) for i, r in enumerate(rows)]
    for ep in episodes:
        ep.reset()
    got = envs.step_all(episodes, ["x"] * 4, workers=4)
    assert marks == ["in", "out"] and len(got) == 4
    envs.step_all(episodes[:1], ["x"], workers=4)
    assert marks == ["in", "out"]


def _run(tmp_path: Path, name: str, *extra: str) -> Path:
    from posttrain.cli import main

    out = tmp_path / name
    code = main(["grpo", "--model", "builtin-episodes", "--env", "builtin",
                 "--output_dir", str(out), "--max_steps", "4", "--prompts_per_step", "4",
                 "--group_size", "4", "--max_new_tokens", "6", "--eval_every", "0",
                 "--builtin_eval_size", "0", "--log_every", "1", "--device", "cpu",
                 "--tensorboard", "false", "--seed", "3", "--async_staleness", "1",
                 "--async_producer", "process", "--env_workers", "8", *extra])
    assert code == 0
    return out


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_an_adaptive_run_takes_every_core_while_the_environment_waits(tmp_path, threads):
    """With a slow environment the producer process raises its flag and the learner runs
    part of its steps at every core; the run learns as a split one does (its metrics are
    the same keys), and the test process's thread count is put back."""
    torch.set_num_threads(1)
    # (waits of 0.2 s a turn: most of the producer's time, so the learner's update, which
    # runs beside the making of the next batch, meets one on any machine)
    out = _run(tmp_path, "adaptive", "--env_kwargs", json.dumps({"latency_s": 0.2}),
               "--async_cores", "adaptive")
    assert torch.get_num_threads() == 1
    steps = [r for r in _rows(out) if "async/staleness" in r]
    assert len(steps) == 4
    spent = [r["time/learner_all_cores_s"] for r in steps]
    assert all(s >= 0 for s in spent) and sum(spent) > 0, spent
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in steps)


def test_async_cores_is_read_only_with_a_producer_process(tmp_path):
    from posttrain.config import ConfigError, RLConfig

    for kw, match in [({"async_cores": "most"}, "async_cores must be split or adaptive"),
                      ({"async_cores": "adaptive"}, "unknown key 'async_cores'"),
                      ({"async_cores": "adaptive", "async_staleness": 1,
                        "async_producer": "thread"}, "unknown key 'async_cores'")]:
        cfg = RLConfig(output_dir=str(tmp_path), **kw)
        cfg.given = set(kw)
        with pytest.raises(ConfigError, match=match):
            cfg.validate()
    cfg = RLConfig(output_dir=str(tmp_path), async_staleness=1, async_cores="adaptive")
    cfg.given = {"async_staleness", "async_cores"}
    cfg.validate()
