"""The fields of a batch record (:class:`~posttrain.rollout.types.Rollout`) declared once, and
the operations on whole records derived from that declaration.

Each field of the record's dataclass carries a :class:`Part` in its ``metadata`` (made by
:func:`row_tensor`, :func:`row_vector`, :func:`row_list`, :func:`row_dict`, :func:`scalar`
or :func:`opaque`): what kind of value it holds, and so what each operation does with it.

============  ==============================================================================
kind          value
============  ==============================================================================
row_tensor    a tensor whose first dimension is the sample; :func:`concat` pads one other
              dimension (the columns) with the part's ``pad`` value
row_vector    a tensor of one value per sample, ``(N,)`` (``renumber``: group ids, which
              :func:`concat` renumbers so that the records' groups stay distinct)
row_list      a list of one JSON-able value per sample
row_dict      named per-sample float64 columns ``{name: (N,)}``; a name some records lack
              is 0 for their samples
scalar        one JSON-able value for the whole record; :func:`concat` joins the records'
              values with the part's ``join`` (``min``, say)
opaque        an object with its own ``rows(rows)`` and class method ``concat(parts, T)``,
              None by default; neither gathered to other ranks nor checkpointed
============  ==============================================================================

The operations: :func:`select` (some rows), :func:`concat` (records one after the other),
:func:`portable` (without its opaque fields: what may be sent to another rank), and
:func:`to_state` / :func:`from_state` (JSON-able values and tensors, for a checkpoint).
Pickling (the pipe from a producer process, whose tensors travel in shared memory, and the
gathers between ranks, of :func:`portable` records) takes every field of the dataclass as
it is. Each operation takes
the record's class from the record, so a subclass with fields of its own (each with its
part) goes through all of them. A field without a part is a ``TypeError`` naming it at
the first operation on its class (:class:`~posttrain.rollout.types.Rollout`'s are checked
when its module is imported), never a field an operation leaves out.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

KEY = "posttrain.record"
"""The key of a field's :class:`Part` in its ``metadata``."""

ROW_TENSOR, ROW_VECTOR, ROW_LIST = "row_tensor", "row_vector", "row_list"
ROW_DICT, SCALAR, OPAQUE = "row_dict", "scalar", "opaque"
KINDS = (ROW_TENSOR, ROW_VECTOR, ROW_LIST, ROW_DICT, SCALAR, OPAQUE)

PAD_ID = "pad_id"
"""A row tensor's ``pad``: the pad id :func:`concat` is given."""


@dataclass(frozen=True)
class Part:
    """What kind of value one field of a record holds (see the module docstring)."""

    kind: str
    pad: float | str | None = None
    """row_tensor: the value its new columns hold after :func:`concat` (:data:`PAD_ID`:
    the pad id)."""
    dim: int = 1
    """row_tensor: the dimension :func:`concat` pads."""
    to: str = "completion"
    """row_tensor: how far :func:`concat` pads it: ``completion``, to the joined
    completions' width (the widest of every such field of the records, or the ``width``
    asked for if more); ``widest``, to the widest of this field's own values."""
    stand_in: Callable[[Any], torch.Tensor] | None = None
    """row_tensor, row_vector (a field that may be None): what stands for it in a record
    that has none (given that record) when :func:`concat` joins it with one that has; None:
    the joined record has none unless every record has one."""
    renumber: bool = False
    """row_vector: the values are group ids, renumbered by :func:`concat` so that the
    groups of different records stay distinct."""
    join: Callable[[list], Any] | None = None
    """scalar: the joined record's value from the records' values."""
    saved_as: str | None = None
    """The field's key in :func:`to_state`'s output (None: its name)."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown record field kind {self.kind!r}; one of {KINDS}")
        if self.kind == ROW_TENSOR and (self.pad is None or self.to not in ("completion",
                                                                            "widest")):
            raise ValueError("a row tensor states its pad value and pads to 'completion' "
                             "or 'widest'")
        if self.kind == SCALAR and self.join is None:
            raise ValueError("a scalar states how concat joins the records' values")


def row_tensor(pad: float | str, *, dim: int = 1, to: str = "completion",
               stand_in: Callable[[Any], torch.Tensor] | None = None) -> dict:
    """The ``metadata`` of a row tensor field padded with ``pad`` along ``dim``."""
    return {KEY: Part(ROW_TENSOR, pad=pad, dim=dim, to=to, stand_in=stand_in)}


def row_vector(*, renumber: bool = False,
               stand_in: Callable[[Any], torch.Tensor] | None = None) -> dict:
    """The ``metadata`` of an ``(N,)`` tensor field (``renumber``: group ids)."""
    return {KEY: Part(ROW_VECTOR, renumber=renumber, stand_in=stand_in)}


def row_list() -> dict:
    """The ``metadata`` of a field holding a list of one value per sample."""
    return {KEY: Part(ROW_LIST)}


def row_dict() -> dict:
    """The ``metadata`` of a field of named per-sample float64 columns (or None)."""
    return {KEY: Part(ROW_DICT)}


def scalar(join: Callable[[list], Any], *, saved_as: str | None = None) -> dict:
    """The ``metadata`` of a whole-record value, joined by ``join`` on concat."""
    return {KEY: Part(SCALAR, join=join, saved_as=saved_as)}


def opaque() -> dict:
    """The ``metadata`` of an object field with its own ``rows`` and ``concat``."""
    return {KEY: Part(OPAQUE)}


@functools.cache
def parts(cls: type) -> tuple[tuple[str, Part], ...]:
    """Each field of the record class ``cls`` with its :class:`Part`, in declaration order;
    a ``TypeError`` names a field without one."""
    out = []
    for f in dataclasses.fields(cls):
        part = f.metadata.get(KEY)
        if not isinstance(part, Part):
            raise TypeError(
                f"{cls.__name__}.{f.name} does not say what kind of field it is: declare it "
                f"with field(metadata=row_tensor(...)) or another of posttrain.rollout.record's "
                f"kinds, so that select, concat and the checkpoint know what to do with it")
        if not f.init:
            raise TypeError(f"{cls.__name__}.{f.name}: a record's fields are all init fields")
        if part.kind == OPAQUE and f.default is not None:
            raise TypeError(f"{cls.__name__}.{f.name}: an opaque field defaults to None")
        out.append((f.name, part))
    return tuple(out)


def _rows(r) -> int:
    """How many samples the record ``r`` holds (the length of its first per-sample field)."""
    for name, part in parts(type(r)):
        v = getattr(r, name)
        if part.kind in (ROW_TENSOR, ROW_VECTOR, ROW_LIST) and v is not None:
            return len(v)
    raise TypeError(f"{type(r).__name__} has no per-sample field")


def select(r, rows: torch.Tensor):
    """The samples ``rows`` (indices, in order) of the record ``r``; group ids are kept."""
    idx = rows.tolist()
    out = {}
    for name, part in parts(type(r)):
        v = getattr(r, name)
        if part.kind == SCALAR:
            out[name] = v
        elif part.kind == ROW_LIST:
            out[name] = [v[i] for i in idx]
        elif v is None:
            out[name] = None
        elif part.kind == ROW_DICT:
            out[name] = {k: x[rows] for k, x in v.items()}
        elif part.kind == OPAQUE:
            out[name] = v.rows(rows)
        else:
            out[name] = v[rows]
    return type(r)(**out)


def concat(records: list, pad_id: int, width: int = 0):
    """One record from several (of the first's class); row tensors padded to the longest
    completion (or ``width`` columns, if more), group ids renumbered so groups stay
    distinct."""
    ps = parts(type(records[0]))
    T = max([width, *(getattr(r, name).shape[part.dim] for r in records for name, part in ps
                      if part.kind == ROW_TENSOR and part.to == "completion"
                      and getattr(r, name) is not None)])
    out = {}
    for name, part in ps:
        values = [getattr(r, name) for r in records]
        if part.kind == SCALAR:
            out[name] = part.join(values)
        elif part.kind == ROW_LIST:
            out[name] = [x for v in values for x in v]
        elif part.kind == ROW_DICT:
            out[name] = _join_columns(values, [_rows(r) for r in records])
        elif part.kind == OPAQUE:
            out[name] = (None if not values or any(v is None for v in values)
                         else type(values[0]).concat(values, T))
        else:
            out[name] = _join_tensors(part, values, records, pad_id, T)
    return type(records[0])(**out)


def _join_tensors(part: Part, values: list, records: list, pad_id: int, T: int):
    """A row tensor's or row vector's values joined (see :class:`Part`)."""
    if any(v is None for v in values):
        if part.stand_in is None or all(v is None for v in values):
            return None
        values = [part.stand_in(r) if v is None else v for v, r in zip(values, records,
                                                                       strict=True)]
    if part.renumber:
        offset, groups = 0, []
        for v in values:
            _, ids = torch.unique(v, return_inverse=True)
            groups.append(ids + offset)
            offset += int(ids.max()) + 1 if len(ids) else 0
        return torch.cat(groups)
    if part.kind == ROW_VECTOR:
        return torch.cat(values)
    W = T if part.to == "completion" else max(v.shape[part.dim] for v in values)
    value = pad_id if part.pad == PAD_ID else part.pad
    return torch.cat([torch.nn.functional.pad(
        v, (0, 0) * (v.dim() - 1 - part.dim) + (0, W - v.shape[part.dim]), value=value)
        for v in values])


def _join_columns(values: list, counts: list[int]) -> dict[str, torch.Tensor] | None:
    """Row dicts joined (0 for a name a record lacks); None where every record has none."""
    if all(v is None for v in values):
        return None
    keys = sorted({k for v in values if v for k in v})
    return {k: torch.cat([v[k].double() if v and k in v
                          else torch.zeros(n, dtype=torch.float64)
                          for v, n in zip(values, counts, strict=True)]) for k in keys}


def portable(r):
    """The record without its opaque fields (a new record sharing the rest; ``r`` itself
    where it has none): what may be sent to another rank."""
    held = {name: None for name, part in parts(type(r))
            if part.kind == OPAQUE and getattr(r, name) is not None}
    return dataclasses.replace(r, **held) if held else r


def to_state(r) -> tuple[dict, dict[str, torch.Tensor]]:
    """The record as JSON-able values (lists, scalars, the names of a row dict's columns)
    and tensors (row tensors and vectors, and ``{field}.{name}`` for a row dict's
    columns), each under the field's key (:attr:`Part.saved_as`); absent tensors are left
    out. An opaque field that is set cannot be written: a ``RuntimeError``."""
    meta: dict = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, part in parts(type(r)):
        v, key = getattr(r, name), part.saved_as or name
        if part.kind == OPAQUE:
            if v is not None:
                raise RuntimeError(f"a {type(r).__name__} whose {name} is set cannot be "
                                   f"checkpointed ({type(v).__name__} is opaque)")
        elif part.kind in (SCALAR, ROW_LIST):
            meta[key] = v
        elif part.kind == ROW_DICT:
            meta[key] = list(v or {})
            tensors.update({f"{key}.{k}": x for k, x in (v or {}).items()})
        elif v is not None:
            tensors[key] = v
    return meta, tensors


def from_state(cls: type, meta: dict, tensors: dict[str, torch.Tensor]):
    """The record of class ``cls`` that :func:`to_state` wrote; a field the state does not
    hold takes its default (a tensor field: None), opaque fields None."""
    out = {}
    for name, part in parts(cls):
        key = part.saved_as or name
        if part.kind in (ROW_TENSOR, ROW_VECTOR):
            out[name] = tensors.get(key)
        elif part.kind == ROW_DICT:
            out[name] = {k: tensors[f"{key}.{k}"] for k in meta.get(key, ())} or None
        elif part.kind == ROW_LIST and key in meta:
            out[name] = [list(x) if isinstance(x, list | tuple) else x for x in meta[key]]
        elif part.kind == SCALAR and key in meta:
            out[name] = meta[key]
    return cls(**out)
