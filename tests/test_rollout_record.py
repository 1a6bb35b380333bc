"""The rollout record's fields are declared once (``posttrain.rollout.record``): a subclass of
:class:`Rollout` with one more field of each kind keeps them through every path a rollout
takes — rows selected, rounds joined, gathered from other ranks, sent from a producer
process, written to a checkpoint and read back — and a field that does not say what kind it
is fails at the first operation instead of being dropped."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.rollout import Rollout, concat, record, select
from posttrain.rollout.types import portable
from posttrain.trainers.online.experience import Experience
from posttrain.trainers.online.producer import experience_from_state, experience_state


@dataclass
class Notes:
    """An opaque per-sample object with its own ``rows`` and ``concat`` (which notes the
    width it was given)."""

    items: list

    def rows(self, rows: torch.Tensor) -> Notes:
        return Notes([self.items[i] for i in rows.tolist()])

    @classmethod
    def concat(cls, parts: list[Notes], T: int) -> Notes:
        return cls([x for p in parts for x in p.items] + [f"T={T}"])


@dataclass
class Wider(Rollout):
    """A rollout with one more field of each kind."""

    extra_tensor: torch.Tensor | None = field(default=None, metadata=record.row_tensor(-7))
    extra_vector: torch.Tensor | None = field(default=None, metadata=record.row_vector())
    extra_list: list[str] = field(default_factory=list, metadata=record.row_list())
    extra_dict: dict[str, torch.Tensor] | None = field(default=None,
                                                        metadata=record.row_dict())
    extra_scalar: int = field(default=0, metadata=record.scalar(max))
    extra_opaque: Any = field(default=None, metadata=record.opaque())


EXTRAS = ("extra_tensor", "extra_vector", "extra_list", "extra_dict", "extra_scalar",
          "extra_opaque")


def _wider(n: int, width: int, first: int, scalar: int, notes: bool = True) -> Wider:
    """``n`` samples (prompt groups of two) with ``width`` completion columns; every
    value counts up from ``first``."""
    ids = torch.arange(first, first + n * width).reshape(n, width)
    return Wider(prompt_ids=[[first + i] for i in range(n)], completion_ids=ids,
                 completion_mask=torch.ones(n, width, dtype=torch.long),
                 logprobs=-ids.float() / 100, truncated=torch.zeros(n, dtype=torch.bool),
                 group_ids=torch.arange(n) // 2, texts=[f"t{first + i}" for i in range(n)],
                 policy_version=scalar,
                 extra_tensor=ids * 10, extra_vector=torch.arange(first, first + n) * 2,
                 extra_list=[f"x{first + i}" for i in range(n)],
                 extra_dict={f"k{first}": torch.arange(n, dtype=torch.float64) + first},
                 extra_scalar=scalar, extra_opaque=Notes(list(range(first, first + n)))
                 if notes else None)


def _assert_same(a, b) -> None:
    """Every field of the two records equal (tensors: values and dtype)."""
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif isinstance(x, dict):
            assert x.keys() == y.keys(), f.name
            assert all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x), f.name
        else:
            assert x == y, f.name


def test_every_rollout_field_states_its_kind():
    names = [name for name, _ in record.parts(Rollout)]
    assert names == [f.name for f in dataclasses.fields(Rollout)]
    assert [name for name, _ in record.parts(Wider)] == names + list(EXTRAS)


def test_extra_fields_survive_select():
    r = _wider(4, 3, 0, 5)
    got = select(r, torch.tensor([3, 1]))
    assert isinstance(got, Wider)
    assert torch.equal(got.extra_tensor, r.extra_tensor[[3, 1]])
    assert torch.equal(got.extra_vector, torch.tensor([6, 2]))
    assert got.extra_list == ["x3", "x1"]
    assert torch.equal(got.extra_dict["k0"], torch.tensor([3.0, 1.0], dtype=torch.float64))
    assert got.extra_scalar == 5 and got.extra_opaque == Notes([3, 1])


def test_extra_fields_survive_concat():
    a, b = _wider(2, 3, 0, 5), _wider(2, 5, 100, 2)
    got = concat([a, b], pad_id=0)
    assert isinstance(got, Wider)
    assert got.completion_ids.shape == (4, 5)
    assert torch.equal(got.extra_tensor[:2, :3], a.extra_tensor)
    assert (got.extra_tensor[:2, 3:] == -7).all()  # padded with the field's own value
    assert torch.equal(got.extra_tensor[2:], b.extra_tensor)
    assert torch.equal(got.extra_vector, torch.cat([a.extra_vector, b.extra_vector]))
    assert got.extra_list == a.extra_list + b.extra_list
    assert set(got.extra_dict) == {"k0", "k100"}  # a name a round lacks is 0 there
    assert torch.equal(got.extra_dict["k100"], torch.tensor([0, 0, 100, 101.0],
                                                            dtype=torch.float64))
    assert got.extra_scalar == 5 and got.policy_version == 2  # max and min
    assert got.extra_opaque == Notes([0, 1, 100, 101, "T=5"])
    assert concat([a, _wider(2, 3, 9, 0, notes=False)], 0).extra_opaque is None
    wide = concat([a], pad_id=0, width=6)
    assert wide.extra_tensor.shape == (2, 6) and wide.extra_opaque.items[-1] == "T=6"


def test_extra_fields_survive_the_producer_process_pipe_and_the_gather():
    """What a producer process sends (its batches, through a ``torch.multiprocessing``
    pipe: pickled, tensors in shared memory) arrives with every field; what goes to other
    ranks is the same less the opaque fields."""
    r = _wider(4, 3, 0, 5)
    exp = Experience(r, torch.rand(4), {}, torch.ones(4, dtype=torch.bool),
                     torch.ones(4, dtype=torch.bool), 1, 0, local=r, own=torch.arange(4))
    send, receive = mp.get_context("spawn").Pipe()
    try:
        send.send(("ok", (exp, {})))
        status, (back, _) = receive.recv()
    finally:
        send.close()
        receive.close()
    assert status == "ok" and back.rollout.extra_tensor.is_shared()
    _assert_same(back.rollout, r)
    _assert_same(back.local, r)
    gathered = portable(r)
    assert gathered.extra_opaque is None and gathered.cache is None
    _assert_same(gathered, dataclasses.replace(r, extra_opaque=None))
    assert r.extra_opaque is not None  # (the one sampled keeps it)
    plain = _wider(2, 3, 0, 5, notes=False)
    assert portable(plain) is plain


def test_extra_fields_survive_a_checkpoint():
    r = _wider(4, 3, 0, 5, notes=False)
    exp = Experience(r, torch.rand(4), {"env": torch.rand(4, dtype=torch.float64)},
                     torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool), 2, 1,
                     0.5, 0.25, 12, r, torch.arange(4))
    meta, tensors = experience_state(exp)
    meta = json.loads(json.dumps(meta))  # as the checkpoint's JSON holds it
    back = experience_from_state(meta, tensors, rollout_type=Wider)
    _assert_same(back.rollout, r)
    part = experience_from_state(meta, tensors, torch.tensor([1, 2]), rollout_type=Wider)
    _assert_same(part.local, select(r, torch.tensor([1, 2])))
    with pytest.raises(RuntimeError, match="extra_opaque"):
        experience_state(dataclasses.replace(exp, rollout=_wider(4, 3, 0, 5)))


def test_a_field_without_a_kind_fails_at_first_use_naming_it():
    @dataclass
    class Careless(Rollout):
        forgotten: torch.Tensor | None = None

    r = Careless(prompt_ids=[[1]], completion_ids=torch.zeros(1, 2, dtype=torch.long),
                 completion_mask=torch.ones(1, 2, dtype=torch.long), logprobs=torch.zeros(1, 2),
                 truncated=torch.zeros(1, dtype=torch.bool), group_ids=torch.zeros(1),
                 texts=["a"], forgotten=torch.ones(1))
    for op in (lambda: select(r, torch.tensor([0])), lambda: concat([r, r], 0),
               lambda: portable(r), lambda: record.to_state(r)):
        with pytest.raises(TypeError, match=r"Careless\.forgotten"):
            op()


def test_a_kind_states_what_its_operations_need():
    with pytest.raises(ValueError, match="pad"):
        record.Part(record.ROW_TENSOR)
    with pytest.raises(ValueError, match="joins"):
        record.Part(record.SCALAR)
    with pytest.raises(ValueError, match="unknown"):
        record.Part("columns")
