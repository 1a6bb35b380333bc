"""What a weight push hands the rollout servers (``rollout/vllm_server.py``): the weight
stream as safetensors buckets, and the files that servers on this host read — a bucket,
or a LoRA policy's adapter as a peft directory — in one scratch directory in ``/dev/shm``
(memory, not disk) that lives as long as the engine."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

import torch

from posttrain.models.weights import checkpoint_layout
from posttrain.rollout.vllm import _with_head


def buckets(model, tied, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
            limit_mb: int) -> Iterator[dict[str, torch.Tensor]]:
    """The stream in the checkpoint layout vLLM's loaders read (``model``'s; ``tied``: its
    tied head's names, sent as a tensor of its own), in buckets of at most ``limit_mb`` MiB
    (a larger tensor goes alone), each ready for safetensors (contiguous, on the CPU, no
    shared storage)."""
    limit, bucket, size = limit_mb << 20, {}, 0
    for name, t in _with_head(checkpoint_layout(model, weights), tied):
        t = t.detach().to("cpu", dtype).contiguous()
        if bucket and size + t.numel() * t.element_size() > limit:
            yield bucket
            bucket, size = {}, 0
        if any(t.data_ptr() == x.data_ptr() for x in bucket.values()):
            t = t.clone()  # (a tied head: safetensors stores no shared tensors)
        bucket[name] = t
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def inline(bucket: dict[str, torch.Tensor]) -> str:
    """A bucket as a base64 safetensors blob, for a server on another host (in the
    request)."""
    import base64

    from safetensors.torch import save

    return base64.b64encode(save(bucket)).decode()


class PushFiles:
    """The engine's scratch directory for servers on this host (made on first use)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.dir: str | None = None
        self._largest = 0
        self._reserve: torch.Tensor | None = None

    def _path(self, name: str) -> str:
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix=f"posttrain-push-{self.run_id}-",
                                        dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        return os.path.join(self.dir, name)

    def bucket(self, tensors: dict[str, torch.Tensor]) -> str:
        """A bucket as a safetensors file (one at a time: unlink it once every server has
        read it), written straight from the tensors: no blob in memory first (at ~180M
        that copy took as long as the write)."""
        from safetensors.torch import save_file

        self._reserve = None  # (freed: its pages, still warm, take the file)
        path = self._path("bucket.safetensors")
        save_file(tensors, path)
        self._largest = max(self._largest, os.path.getsize(path))
        return path

    def keep_warm(self) -> None:
        """After a push (every bucket read and unlinked): hold what the next push writes
        first, the largest bucket (:func:`~posttrain.rollout.vllm_transfer.warm_reserve`;
        fresh pages in ``/dev/shm`` cost the same faults as a server's reload)."""
        from posttrain.rollout.vllm_transfer import warm_reserve

        self._reserve = warm_reserve(self._largest)

    def adapter(self, model, name: str) -> str:
        """``model``'s adapter now (a peft model's), as the directory ``name``."""
        path = self._path(name)
        model.save_pretrained(path, safe_serialization=True)
        return path

    def drop(self, name: str) -> None:
        if self.dir is not None:
            shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def close(self) -> None:
        self._reserve = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
