"""vLLM's NCCL weight transport for rollout servers on GPUs (``--rollout_transfer nccl``).

Rank 0 of the run opens one NCCL group per server at its first push: rank 0 of the group
is the trainer, ranks 1..W the server's workers (its tensor × pipeline × data parallel
world, ``/get_world_size``), joined through ``/init_weight_transfer_engine`` while the
trainer opens its end (vLLM's TCP rendezvous on a free port of ``address``). A bucket of a
push then goes as one ``/update_weights`` naming its tensors (names, dtypes, shapes) while
rank 0 broadcasts them, one after another, in that order: what the server's own ``nccl``
engine (``--weight-transfer-config '{"backend": "nccl"}'``) receives, unpacked, into
vLLM's layerwise reload. The pause, start, finish-with-version and resume around it are
the same calls as posttrain's own transport (:mod:`posttrain.rollout.vllm_server`). The
buckets are built in host memory, as for that transport (the weight stream gathers each
tensor to the CPU), and copied to rank 0's GPU whole before their broadcasts start.

The trainer side uses vLLM's own pieces (its ``StatelessProcessGroup`` rendezvous and
``PyNcclCommunicator``), so the training environment needs vLLM installed.

No hangs: every call into NCCL may block the thread that makes it, so each runs on a
daemon thread of its own, waited for at most ``timeout`` s: the group's opening (the
rendezvous's own wait is that long too; given up at once if the server refuses its init)
and a bucket's broadcasts, which run on a CUDA stream of their own (the training stream
never waits on a server) and are then waited for within the same ``timeout``. A server
that has not taken a bucket by then, or that refused it, has its group aborted
(``ncclCommAbort``, which ends the kernels waiting on it) and is dropped like any server
that stops answering; every failure here is a :class:`ServerDown` naming it. A server
re-admitted later gets a new group."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from posttrain.rollout.server_calls import RolloutServerError, Server, ServerDown


def check() -> None:
    """Raise a one-line error where this transport cannot run (checked when a run starts)."""
    if not torch.cuda.is_available():
        raise ValueError("rollout_transfer nccl needs CUDA on the run's rank 0 (use "
                         "rollout_transfer posttrain)")
    try:
        import vllm.distributed.device_communicators.pynccl  # noqa: F401
    except ImportError as e:
        raise ValueError(f"rollout_transfer nccl needs vLLM installed beside the trainer "
                         f"({e}); or use rollout_transfer posttrain") from None


class _Group:
    """One server's NCCL group as rank 0 holds it, on ``device``: broadcasts on a stream
    of its own."""

    def __init__(self, address: str, world: int, listener: socket.socket, timeout: float,
                 device: int):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env

        self.device = torch.device("cuda", device)
        with torch.cuda.device(self.device):  # (the current device is a thread's own)
            group = StatelessProcessGroup.create(
                host=address, port=listener.getsockname()[1], rank=0, world_size=world,
                store_timeout=max(int(timeout), 1), listen_socket=listener)
            with unpinned_nccl_env():
                self.comm = PyNcclCommunicator(group, device=self.device)
            if self.comm.disabled:  # (NCCL not loadable, or VLLM_DISABLE_PYNCCL set)
                raise RuntimeError("vLLM's PyNcclCommunicator is disabled here")
            self.stream = torch.cuda.Stream()

    def stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` on the GPU (copied on the current stream, which never waits for a
        server), ready for this group's stream."""
        out = [t.to(self.device) for t in tensors]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in out:
            t.record_stream(self.stream)  # (not reused before its broadcast is done)
        return out

    def broadcast(self, tensor: torch.Tensor) -> None:
        with torch.cuda.device(self.device):
            self.comm.broadcast(tensor, src=0, stream=self.stream)

    def done(self) -> bool:
        return self.stream.query()

    def abort(self) -> None:
        self.comm.destroy()


def open_group(address: str, world: int, listener: socket.socket, timeout: float,
               device: int):
    """Rank 0's end of a group of ``world`` whose rendezvous listens on ``listener``, on
    CUDA device ``device`` (it returns once every rank has joined, or raises after
    ``timeout`` s)."""
    return _Group(address, world, listener, timeout, device)


def _bounded(work: Callable[[], None], stop: Callable[[], bool], timeout: float) -> bool:
    """Run ``work`` on a daemon thread (a call into NCCL may block its thread) and wait
    while it runs, at most ``timeout`` s and not once ``stop()`` is true: whether it
    finished. Its exception, if any, is raised here."""
    box: dict = {}

    def run() -> None:
        try:
            work()
        except BaseException as e:
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="nccl")
    worker.start()
    deadline = time.monotonic() + timeout
    while worker.is_alive() and time.monotonic() < deadline and not stop():
        time.sleep(0.001)
    if "error" in box:
        raise box["error"]
    return not worker.is_alive()


class NcclGroups:
    """Rank 0's NCCL groups, by server index (see the module docstring). ``call(server,
    path, body, method)`` is one HTTP call that raises on failure."""

    def __init__(self, address: str, timeout: float, call: Callable[..., dict]):
        self.address, self.timeout, self.call = address, timeout, call
        self.groups: dict[int, object] = {}

    def open(self, server: Server) -> None:
        """Open ``server``'s group (a group it had is aborted first)."""
        self.close(server)
        try:
            world = 1 + int(self.call(server, "/get_world_size", None, "GET")["world_size"])
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.address, 0))  # (a free port, held from here on)
            listener.listen()
        except (KeyError, ValueError, TypeError, OSError) as e:
            if isinstance(e, (ServerDown, RolloutServerError)):
                raise
            raise ServerDown(f"could not start its NCCL group ({type(e).__name__}: {e})",
                             False) from None
        info = {"master_address": self.address, "master_port": listener.getsockname()[1],
                "rank_offset": 1, "world_size": world, "packed": False}
        device = torch.cuda.current_device() if torch.cuda.is_available() else -1
        lock, box = threading.Lock(), {}  # (-1: the tests' stand-in groups need no device)

        def opening() -> None:  # (the server's workers join while this end opens)
            group = open_group(self.address, world, listener, self.timeout, device)
            with lock:  # (given up meanwhile: this side aborts it, the other never sees it)
                if box.get("late"):
                    group.abort()
                else:
                    box["group"] = group

        pool = ThreadPoolExecutor(1, thread_name_prefix="nccl-join")
        try:
            joined = pool.submit(self.call, server, "/init_weight_transfer_engine",
                                 {"init_info": info}, "POST")
            opened = _bounded(opening, lambda: joined.done() and joined.exception()
                              is not None, self.timeout)
            if not opened and not (joined.done() and joined.exception() is not None):
                raise ServerDown(f"did not join its NCCL group within {self.timeout:g} s",
                                 True)
            joined.result(timeout=max(self.timeout, 1.0))  # (its refusal, if it refused)
        except Exception as e:
            with lock:
                box["late"] = True
                group = box.pop("group", None)
            if group is not None:
                group.abort()
            if isinstance(e, ServerDown) and e.timed_out:
                raise
            raise ServerDown(f"did not join its NCCL group ({type(e).__name__}: {e})",
                             False) from None
        finally:
            pool.shutdown(wait=False)
            listener.close()  # (the store took its own descriptor: this one is spare)
        self.groups[server.index] = box["group"]

    def send(self, server: Server, bucket: dict[str, torch.Tensor]) -> None:
        """One bucket to ``server``: its ``/update_weights`` and the broadcasts it reads."""
        group = self.groups[server.index]
        info = {"names": list(bucket),
                "dtype_names": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
                "shapes": [list(t.shape) for t in bucket.values()]}
        pool = ThreadPoolExecutor(1, thread_name_prefix="nccl-update")
        try:
            staged = group.stage(list(bucket.values()))
            deadline = time.monotonic() + self.timeout
            received = pool.submit(self.call, server, "/update_weights",
                                   {"update_info": info}, "POST")

            def refused() -> bool:
                return received.done() and received.exception() is not None

            def broadcasts() -> None:
                for t in staged:
                    group.broadcast(t)

            sent = _bounded(broadcasts, refused, self.timeout)
            while sent and not (group.done() and received.done()) and not refused() and \
                    time.monotonic() < deadline:
                time.sleep(0.001)
            e = received.exception() if refused() else None
            if e is not None or not sent or not (group.done() and received.done()):
                self.close(server)  # (ends the broadcasts waiting for it)
                if e is not None and not getattr(e, "timed_out", False):
                    raise e  # (it refused the bucket: its answer names why)
                raise ServerDown(f"did not take a weight bucket over NCCL within "
                                 f"{self.timeout:g} s", True)
        except (ServerDown, RolloutServerError):
            raise
        except Exception as e:  # (CUDA or NCCL said no)
            self.close(server)
            raise ServerDown(f"NCCL push failed ({type(e).__name__}: {e})", False) from None
        finally:
            pool.shutdown(wait=False)

    def close(self, server: Server) -> None:
        group = self.groups.pop(server.index, None)
        if group is not None:
            group.abort()

    def close_all(self) -> None:
        for index in list(self.groups):
            self.groups.pop(index).abort()
