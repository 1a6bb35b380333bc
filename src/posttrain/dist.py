"""The one place that talks to ``torch.distributed``: the world a run belongs to, the sums
across ranks that make a step's update independent of the world size, and rank 0 as the
only writer. Launch with ``torchrun --nproc_per_node N -m posttrain <command> ...``
(multi-node: torchrun's ``--nnodes`` and rendezvous flags); gloo on CPU, NCCL on CUDA. A
process started without torchrun is a world of one, and every function here is then a
no-op.

What is implemented: data parallelism for every trainer. Offline (SFT, reward model, DPO):
each rank takes its share of every micro-batch, the loss is normalised by the unit count
of the whole step across ranks, and the gradients are summed across ranks before the
optimiser step, so N ranks compute the update of one. On-policy (the GRPO family, PPO):
each rank samples and scores whole prompt groups, the step's samples are gathered so that
every rank holds the same experience (scores, masks, advantages, every decision), each
rank runs the passes and the backward of its own samples, and the gradients are summed.
Sharding the models (``parallel=fsdp``) is :mod:`posttrain.sharding`'s.

Context parallelism (``--context_parallel k``, :mod:`posttrain.models.context_parallel`)
splits the world into groups of k consecutive ranks that hold the same data and split each
sequence's tokens among them: the data-parallel world is then ``world_size // k`` replicas
(:func:`data_rank`, :func:`data_world`), and a sum of values every rank of a group holds
alike counts each group once (:func:`data_sum`). Gradients are still summed over every rank:
a group's ranks each hold the part of the gradient that flows through their own tokens.
"""

from __future__ import annotations

import os

import torch


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets the
    ``torch.distributed`` environment) for a world of more than one."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: torch.device | str = "cpu", required: bool = False) -> None:
    """Join the process group of a launched run (once); nothing for a world of one unless
    ``required`` (FSDP needs a group even then: one of its own, in this process)."""
    import torch.distributed as td

    if td.is_initialized() or not (launched() or required):
        return
    kind = torch.device(device).type
    backend = "nccl" if kind == "cuda" else "gloo"
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if launched() or "MASTER_ADDR" in os.environ:
        td.init_process_group(backend)
    else:
        td.init_process_group(backend, store=td.HashStore(), rank=0, world_size=1)


def world_size() -> int:
    import torch.distributed as td

    return td.get_world_size() if td.is_available() and td.is_initialized() else 1


def rank() -> int:
    import torch.distributed as td

    return td.get_rank() if td.is_available() and td.is_initialized() else 0


_CONTEXT: dict = {"size": 1, "group": None}
"""This process's context-parallel group (:func:`set_context`): its size and the
``torch.distributed`` group of its ranks (None for a size of 1)."""


def set_context(k: int) -> None:
    """Split the world into context-parallel groups of ``k`` consecutive ranks (every rank
    calls it, once, after :func:`init`); ``k`` must divide the world size."""
    world = world_size()
    if k < 1 or world % k:
        from posttrain.config import ConfigError

        raise ConfigError(f"context_parallel {k} must divide the {world} ranks (launch with "
                          f"torchrun --nproc_per_node a multiple of {k})")
    _CONTEXT.update(size=k, group=None)
    if k == 1:
        return
    import torch.distributed as td

    for first in range(0, world, k):  # every rank makes every group, in the same order
        group = td.new_group(list(range(first, first + k)), backend="gloo"
                             if td.get_backend() == "gloo" else None)
        if first <= rank() < first + k:
            _CONTEXT["group"] = group


def context_size() -> int:
    """Ranks that split each sequence (``--context_parallel``; 1: none)."""
    return _CONTEXT["size"]


def context_group():
    """The ``torch.distributed`` group of this rank's context-parallel group (None when
    :func:`context_size` is 1)."""
    return _CONTEXT["group"]


def context_rank() -> int:
    """This rank's place in its context-parallel group (which part of a sequence it holds)."""
    return rank() % context_size()


def data_world() -> int:
    """Data-parallel replicas: the ranks that hold different data (the world without
    context parallelism)."""
    return world_size() // context_size()


def data_rank() -> int:
    """This rank's data-parallel replica: which share of the data it holds."""
    return rank() // context_size()


def data_sum(values: list[float]) -> list[float]:
    """``values`` that every rank of a context-parallel group holds alike, summed over the
    data-parallel replicas (:func:`sum_floats` counting each group once)."""
    own = context_rank() == 0  # one rank of each group speaks for it: the sum stays exact
    return sum_floats([float(v) if own else 0.0 for v in values])


def is_main() -> bool:
    """Rank 0: the one process that prints, logs and writes files."""
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        import torch.distributed as td

        td.barrier()


def sum_floats(values: list[float]) -> list[float]:
    """``values`` summed over ranks (float64), in one collective (on the current GPU under
    NCCL, which takes no host tensors)."""
    if world_size() == 1:
        return list(values)
    import torch.distributed as td

    device = (torch.device("cuda", torch.cuda.current_device())
              if td.get_backend() == "nccl" else torch.device("cpu"))
    t = torch.tensor(values, dtype=torch.float64, device=device)
    td.all_reduce(t)
    return t.tolist()


def flat_gradients(params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """With several ranks: one buffer holding every gradient of ``params`` (each ``.grad`` a
    view into it, zeroed), so the sum across ranks is one collective on it with no copy in
    or out; keep the views by zeroing with ``set_to_none=False``. None for a world of one or
    mixed dtypes."""
    if world_size() == 1 or len({p.dtype for p in params}) != 1:
        return None
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def sum_flat(flat: torch.Tensor) -> None:
    """Sum a :func:`flat_gradients` buffer across ranks, in place."""
    import torch.distributed as td

    td.all_reduce(flat)


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """Replace each gradient by its sum over ranks (one flat collective per dtype); a rank
    whose parameter got no gradient contributes zeros."""
    if world_size() == 1:
        return
    import torch.distributed as td

    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        td.all_reduce(flat)
        offset = 0
        for p in group:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def gather_objects(obj, group=None) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` for a world of one). For small
    things: a step's token ids, scores and texts, a dict of metric sums. ``group``: a
    process group of every rank other than the default one (:func:`side_group`)."""
    if world_size() == 1:
        return [obj]
    import torch.distributed as td

    out: list = [None] * world_size()
    td.all_gather_object(out, obj, group=group)
    return out


def side_group():
    """A second group of every rank (gloo), for collectives another thread runs while the
    main thread's run on the default group; None for a world of one. Every rank calls it,
    at the same point."""
    if world_size() == 1:
        return None
    import torch.distributed as td

    return td.new_group(backend="gloo")


def assemble(local: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """The ``(n, ...)`` tensor whose rows ``rows`` are this rank's ``local`` and whose other
    rows come from the ranks that hold them (each row held by one rank): one all-reduce
    of a zero-filled tensor, exact, since a row's value meets only zeros. The ranks of a
    context-parallel group hold the same rows: its first rank's count."""
    if world_size() == 1 and len(rows) == n:  # every row is this process's, in order
        return local
    out = local.new_zeros((n, *local.shape[1:]))
    if context_rank() == 0:
        out[rows.to(out.device)] = local
    if world_size() > 1:
        import torch.distributed as td

        td.all_reduce(out)
    return out


def shard(items: list) -> list:
    """This rank's share of ``items``: every :func:`data_world`-th one from
    :func:`data_rank` (the ranks of a context-parallel group share one)."""
    return items[data_rank()::data_world()]


def shard_by_cost(items: list, costs: list[float]) -> list:
    """This rank's share of ``items`` balanced by ``costs`` (tokens, say) rather than by
    count, so that the ranks finish together: the costliest first, each to the rank with the
    least so far (ties: the lowest rank), then in their order. Every rank computes the same
    assignment; with at least as many items as ranks none is left empty."""
    ranks, load = data_world(), [0.0] * data_world()
    owner = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + costs[i]
    return [x for x, r in zip(items, owner, strict=True) if r == data_rank()]


def close() -> None:
    """Leave the process group: once every rank is done, and after freeing what still holds
    its work (sharded models sit in reference cycles; a gloo work object left for the
    interpreter's shutdown aborts the process)."""
    import gc

    import torch.distributed as td

    if td.is_available() and td.is_initialized():
        gc.collect()
        if world_size() > 1:
            td.barrier()
        td.destroy_process_group()
