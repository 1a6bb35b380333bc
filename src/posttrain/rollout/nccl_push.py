"""vLLM's NCCL weight transport for rollout servers on GPUs (``--rollout_transfer nccl``).

Rank 0 of the run opens one NCCL group per server at its first push: rank 0 of the group
is the trainer, ranks 1..W the server's workers (its tensor × pipeline × data parallel
world, ``/get_world_size``), joined through ``/init_weight_transfer_engine`` while the
trainer opens its end (vLLM's TCP rendezvous, on a free port of ``address``). A bucket of
a push then goes as one ``/update_weights`` naming its tensors (names, dtypes, shapes)
while rank 0 broadcasts them, one after another, in that order: what the server's own
``nccl`` engine (``--weight-transfer-config '{"backend": "nccl"}'``) receives, unpacked,
into vLLM's layerwise reload. The pause, start, finish-with-version and resume around it
are the same calls as posttrain's own transport (:mod:`posttrain.rollout.vllm_server`).

The trainer side uses vLLM's own pieces (``nccl_common.trainer_init``, its
``PyNcclCommunicator``), so the training environment needs vLLM installed.

No hangs: the broadcasts run on a CUDA stream of their own (the training stream never
waits on a server) and are waited for at most ``timeout`` s; a server that has not taken a
bucket by then, or that answered its ``/update_weights`` with an error, has its group
aborted (``ncclCommAbort``, which ends the kernels waiting on it) and is dropped like any
server that stops answering. A server re-admitted later gets a new group."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as Late

import torch

from posttrain.rollout.server_calls import RolloutServerError, Server, ServerDown


class _Group:
    """One server's NCCL group as rank 0 holds it: broadcasts on a stream of its own."""

    def __init__(self, address: str, port: int, world: int):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.comm = trainer_init({"master_address": address, "master_port": port,
                                  "world_size": world})
        self.stream = torch.cuda.Stream()
        self.device = torch.device("cuda", torch.cuda.current_device())

    def broadcast(self, tensor: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):  # (the copy lives on the stream that reads it)
            self.comm.broadcast(tensor.to(self.device, non_blocking=True), src=0,
                                stream=self.stream)

    def done(self) -> bool:
        return self.stream.query()

    def abort(self) -> None:
        self.comm.destroy()


def open_group(address: str, port: int, world: int):
    """Rank 0's end of a group of ``world`` (it returns once every rank has joined)."""
    if not torch.cuda.is_available():
        raise RolloutServerError("rollout_transfer nccl needs CUDA on the run's rank 0 (use "
                                 "rollout_transfer posttrain)")
    return _Group(address, port, world)


class NcclGroups:
    """Rank 0's NCCL groups, by server index (see the module docstring). ``call(server,
    path, body, method)`` is one HTTP call that raises on failure."""

    def __init__(self, address: str, timeout: float, call: Callable[..., dict]):
        self.address, self.timeout, self.call = address, timeout, call
        self.groups: dict[int, object] = {}

    def open(self, server: Server) -> None:
        """Open ``server``'s group (a group it had is aborted first)."""
        from posttrain.rollout.fleet import free_port

        self.close(server)
        world = 1 + int(self.call(server, "/get_world_size", None, "GET")["world_size"])
        info = {"master_address": self.address, "master_port": free_port(),
                "rank_offset": 1, "world_size": world, "packed": False}
        pool = ThreadPoolExecutor(1, thread_name_prefix="nccl-join")
        try:  # (the server's workers join while this end opens: both wait for the other)
            joined = pool.submit(self.call, server, "/init_weight_transfer_engine",
                                 {"init_info": info}, "POST")
            group = open_group(self.address, info["master_port"], world)
            try:
                joined.result(timeout=self.timeout)
            except Late:
                group.abort()
                raise ServerDown(f"did not join its NCCL group within {self.timeout:g} s",
                                 True) from None
        finally:
            pool.shutdown(wait=False)
        self.groups[server.index] = group

    def send(self, server: Server, bucket: dict[str, torch.Tensor]) -> None:
        """One bucket to ``server``: its ``/update_weights`` and the broadcasts it reads."""
        group = self.groups[server.index]
        info = {"names": list(bucket),
                "dtype_names": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
                "shapes": [list(t.shape) for t in bucket.values()]}
        deadline = time.monotonic() + self.timeout
        pool = ThreadPoolExecutor(1, thread_name_prefix="nccl-update")
        try:
            received = pool.submit(self.call, server, "/update_weights",
                                   {"update_info": info}, "POST")
            for t in bucket.values():
                group.broadcast(t)
            while not group.done():
                failed = received.done() and received.exception() is not None
                if failed or time.monotonic() > deadline:
                    self.close(server)  # (ends the broadcasts waiting for it)
                    if failed:
                        received.result()
                    raise ServerDown(f"did not take a weight bucket over NCCL within "
                                     f"{self.timeout:g} s", True)
                time.sleep(0.001)
            received.result(timeout=max(deadline - time.monotonic(), 0.0))
        except Late:
            self.close(server)
            raise ServerDown(f"did not answer /update_weights within {self.timeout:g} s",
                             True) from None
        finally:
            pool.shutdown(wait=False)

    def close(self, server: Server) -> None:
        group = self.groups.pop(server.index, None)
        if group is not None:
            group.abort()

    def close_all(self) -> None:
        for index in list(self.groups):
            self.groups.pop(index).abort()
