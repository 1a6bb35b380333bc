"""The weight transport posttrain registers in vLLM servers: the server side of a push.

vLLM's RL API updates a server's weights in four calls (``/start_weight_update``, any
number of ``/update_weights``, ``/finish_weight_update`` with the new version), each
delegated to a *weight transfer engine* the server was started with
(``--weight-transfer-config '{"backend": "posttrain"}'``). vLLM's own engines (``nccl``,
``ipc``, …) move tensors between GPUs; this one moves them on any device, CPU included:
each ``/update_weights`` carries one bucket of (Hugging Face name, tensor) pairs as a
safetensors blob, inline (base64 in the request) or as a file the trainer wrote on the
server's host (``/dev/shm``), and the bucket is loaded with the model's own
``load_weights`` inside vLLM's layerwise reload (the same path its ``ipc`` engine takes).

It is registered by :func:`register`, which vLLM calls in each of its processes as a
general plugin (the ``vllm.general_plugins`` entry point in posttrain's package metadata),
so a server finds it wherever posttrain is installed beside vLLM.

A push must carry the run's key, which the server reads from ``POSTTRAIN_ROLLOUT_KEY`` in
its environment (servers a run launches always have it; a server without it refuses every
push): vLLM's RL endpoints themselves take no API key. Only safetensors are read; nothing
is unpickled.

This module imports vLLM; only the server imports it."""

from __future__ import annotations

import base64
import contextlib
import hmac
import os
from dataclasses import dataclass

import torch

BACKEND = "posttrain"
KEY_ENV = "POSTTRAIN_ROLLOUT_KEY"


def register() -> None:
    """vLLM's plugin hook: register the ``posttrain`` weight transfer engine (once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already (one hook call per process)
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "BucketTransferEngine")


def warm_reserve(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of memory, written (so backed by pages), for the server to hold between
    two weight updates and free just before the next. A reload on the CPU allocates each
    layer afresh, and oneDNN repacks it, at every update; the pages the last one freed are
    soon handed back to the host where the machine is a virtual one that reports free
    pages (a balloon with free page reporting, as on this project's CI machines), and
    faulting them in again cost 0.7–1.1 s of a ~180M push for its 311 MB embedding alone.
    Allocated right after an update, the reserve takes pages that are still warm; freed
    right before the next, it hands them to the reload. Held between updates: twice the
    worker's largest parameter (a layer's new copy and its repacked one)."""
    return torch.ones(nbytes, dtype=torch.uint8) if nbytes > 0 else None


def _engine_classes():
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class InitInfo(WeightTransferInitInfo):
        key: str = ""
        reserve: bool = True
        """Whether to hold a warm reserve between updates (:func:`warm_reserve`; not
        when no update follows, as in a LoRA run that pushes its adapter after the base)."""

    @dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        key: str = ""
        data: str | None = None
        """A safetensors blob, base64."""
        path: str | None = None
        """A safetensors file on this host (on the CPU its tensors are views of the file:
        the trainer may rewrite it in place at the next push, so nothing may hold them
        past ``finish_weight_update``)."""

    class BucketTransferEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        """Buckets of (name, tensor) as safetensors, loaded by the model's
        ``load_weights`` within a layerwise reload (see the module docstring)."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def _check(self, key: str) -> None:
            want = os.environ.get(KEY_ENV)
            if not want:
                raise PermissionError(f"weight push refused: this server was started "
                                      f"without {KEY_ENV}, so it cannot tell its trainer's "
                                      "pushes from anyone's")
            if not hmac.compare_digest(key.encode(), want.encode()):
                raise PermissionError("weight push refused: it does not carry this "
                                      "server's run key")

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            self._check(init_info.key)
            self._hold_reserve = init_info.reserve

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self._reserve = None  # (freed: its pages, still warm, serve the reload)
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type != "cpu":
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: UpdateInfo) -> None:
            from safetensors.torch import load, load_file

            self._check(update_info.key)
            if (update_info.data is None) == (update_info.path is None):
                raise ValueError("a bucket is either data or path")
            tensors = (load(base64.b64decode(update_info.data)) if update_info.data is not None
                       else load_file(update_info.path))
            self.model.load_weights([(n, t.to(self.device)) for n, t in tensors.items()])

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            if self.device.type == "cpu" and getattr(self, "_hold_reserve", True):
                # (the worker's own largest parameter: its shard under tensor parallelism,
                # a fused one where vLLM fuses what the push sends apart)
                largest = max((p.nbytes for p in self.model.parameters()), default=0)
                self._reserve = warm_reserve(2 * largest)

        def shutdown(self) -> None:
            pass

    return BucketTransferEngine


def __getattr__(name: str):
    if name == "BucketTransferEngine":  # built on first use: the base classes are vLLM's
        cls = _engine_classes()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
