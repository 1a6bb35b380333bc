"""The two sides of an RL run (trainers/online/sides.py): one factory places the sampler
side; the learner holds it only through its messages, whatever the placement."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from posttrain.config import RLConfig
from posttrain.trainers.online import sides
from posttrain.trainers.online.trainer import RLTrainer


def _cfg(model_dir, out, **kw):
    base = dict(model=model_dir, output_dir=str(out), algo="grpo", max_steps=2,
                prompts_per_step=2, group_size=2, max_new_tokens=4, builtin_train_size=8,
                builtin_eval_size=4, log_every=1, eval_every=0, device="cpu",
                tensorboard=False)
    base.update(kw)
    cfg = RLConfig(**base)
    cfg.validate()
    return cfg


@pytest.mark.parametrize(("kw", "kind", "producer"), [
    ({}, sides.InlineSide, None),
    ({"async_staleness": 1, "async_producer": "thread"}, sides.AheadSide, "Producer"),
])
def test_the_factory_places_the_sampler_side(tiny_model_dir, tmp_path, kw, kind, producer):
    t = RLTrainer(_cfg(tiny_model_dir, tmp_path, **kw))
    try:
        assert type(t.side) is kind
        assert type(getattr(t.side, "producer", None)).__name__ == (producer or "NoneType")
        assert t.engine is t.side.engine and t.engine is not None
    finally:
        t.close()


def test_a_process_side_leaves_the_learner_without_an_engine(tiny_model_dir, tmp_path,
                                                             monkeypatch):
    """With async_producer process the engine lives in the producer's process: the learner
    builds none (a stand-in for the process records what it was given)."""
    made = {}

    class Remote:
        def __init__(self, cfg, extras, weights, version=0):
            made.update(extras=extras, names=[n for n, _ in weights])

        def close(self):
            made["closed"] = True

        def stuck(self):
            return False

    def no_engine(*a, **k):
        raise AssertionError("the learner built an engine")

    import posttrain.trainers.online.remote as remote

    monkeypatch.setattr(remote, "RemoteProducer", Remote)
    monkeypatch.setattr(sides, "build_engine", no_engine)
    t = RLTrainer(_cfg(tiny_model_dir, tmp_path, async_staleness=1, async_producer="process"))
    assert t.engine is None and t.experience is None
    assert not t.side.traits.shares_weights and t.side.traits.extras == frozenset()
    assert made["extras"] == frozenset() and "model.embed_tokens.weight" in made["names"]
    t.close()
    assert made["closed"]


def test_the_learner_never_branches_on_the_placement():
    """RLTrainer reads no placement key and touches no producer: the side's messages are
    its only way to the sampler (the factory alone reads async_staleness and
    async_producer)."""
    tree = ast.parse(inspect.getsource(RLTrainer))
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"async_staleness", "async_producer", "async_process", "producer"}
    calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Attribute)
             and n.func.value.attr == "side"}
    assert calls == {"take", "publish", "keep", "evaluate", "state", "load_state", "close"}


def test_staleness_is_checked_against_the_bound():
    from types import SimpleNamespace

    ro = SimpleNamespace(policy_version=3, versions=None, trained_mask=torch.ones(1, 1))
    exp = SimpleNamespace(rollout=ro)
    assert sides.staleness(exp, 5, 1) == {"async/staleness": 1.0}
    with pytest.raises(RuntimeError, match="2 versions old, beyond async_staleness=1"):
        sides.staleness(exp, 6, 1)
