"""What a weight push hands the rollout servers (``rollout/vllm_server.py``): the weight
stream as safetensors buckets, and the files that servers on this host read — a bucket,
or a LoRA policy's adapter as a peft directory — in one scratch directory in ``/dev/shm``
(memory, not disk) that lives as long as the engine."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
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
    """The engine's scratch directory for servers on this host (made on first use).

    Bucket ``i`` of every push is the file ``bucket-i.safetensors``. When the files are
    **kept** — ``keep_bytes`` (the push's size) given, the directory in ``/dev/shm``, and
    ``/dev/shm`` with twice that free at the first push — a bucket is written by
    safetensors the first time and from then on its tensors are copied into the file where
    they lie (through a mapping held for the run) as long as the bucket holds the same
    names, dtypes and shapes, which a model's pushes do: the files' pages stay with the
    run and a push moves the weights once, at memory speed (writing a fresh file at every
    push took 0.29 s of a ~180M push, most of it getting fresh pages, which on a virtual
    machine that reports free pages to its host come back cold: docs/engines.md). The
    price is one copy of the pushed weights in ``/dev/shm`` for the run. Otherwise each
    bucket is written afresh and removed once the servers have read it (:meth:`release`),
    as a LoRA run's single push of the base weights is. Servers read a bucket during its
    ``/update_weights`` and hold nothing of it after the push (vLLM's layerwise reload
    drops what it buffered), so rewriting it at the next push is safe."""

    def __init__(self, run_id: str, keep_bytes: int = 0):
        self.run_id = run_id
        self.dir: str | None = None
        self.keep_bytes = keep_bytes
        self.keep: bool | None = None
        """Whether the bucket files stay for the run (decided at the first bucket)."""
        self._slots: dict[int, tuple[dict[str, torch.Tensor], int | None]] = {}
        """Per kept bucket index: its tensors' views into the mapped file (its layout), and
        the file's inode (a file removed under the run, or replaced, is written afresh: the
        servers read the path, not the mapping)."""

    def _path(self, name: str) -> str:
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix=f"posttrain-push-{self.run_id}-",
                                        dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            # (removed at close, else when collected or at exit: never left in memory)
            self._remove = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
        return os.path.join(self.dir, name)

    def bucket(self, index: int, tensors: dict[str, torch.Tensor]) -> str:
        """Bucket ``index`` of this push as a safetensors file (see the class docstring):
        its path."""
        path = self._bucket_path(index)
        if self.keep is None:
            self.keep = (self.keep_bytes > 0 and self.dir.startswith("/dev/shm/")
                         and shutil.disk_usage(self.dir).free >= 2 * self.keep_bytes)
        views, inode = self._slots.get(index, (None, None))
        if views is None or _layout(views) != _layout(tensors) or (
                _inode(path) != inode):  # (removed by someone else)
            from safetensors.torch import save_file

            self._slots.pop(index, None)
            os.makedirs(self.dir, exist_ok=True)
            save_file(tensors, path)
            if self.keep:
                self._slots[index] = (_views(path, tensors), _inode(path))
        else:
            for name, t in tensors.items():
                views[name].copy_(t)
        return path

    def release(self, index: int) -> None:
        """Bucket ``index`` of this push has been read by every server: removed unless
        the files are kept."""
        if not self.keep and self.dir is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._bucket_path(index))

    def _bucket_path(self, index: int) -> str:
        return self._path(f"bucket-{index}.safetensors")

    def adapter(self, model, name: str) -> str:
        """``model``'s adapter now (a peft model's), as the directory ``name``."""
        path = self._path(name)
        model.save_pretrained(path, safe_serialization=True)
        return path

    def drop(self, name: str) -> None:
        if self.dir is not None:
            shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def close(self) -> None:
        self._slots = {}
        if self.dir is not None:
            self._remove()
            self.dir = None


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _layout(tensors: dict[str, torch.Tensor]) -> list:
    return [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def _views(path: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each of ``tensors``' places in the safetensors file ``path`` (which holds them), as a
    tensor over a shared mapping of the file: a little-endian u64 header length, the JSON
    header with each tensor's ``data_offsets`` from the end of the header, the data."""
    import json

    size = os.path.getsize(path)
    raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    n = int.from_bytes(bytes(raw[:8].tolist()), "little")
    header = json.loads(bytes(raw[8:8 + n].tolist()))
    views = {}
    for name, t in tensors.items():
        begin, end = (8 + n + x for x in header[name]["data_offsets"])
        views[name] = raw[begin:end].view(t.dtype).view(t.shape)
    return views
