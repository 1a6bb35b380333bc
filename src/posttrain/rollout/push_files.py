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
    """The engine's scratch directory for servers on this host (made on first use).

    Bucket ``i`` of every push is the file ``bucket-i.safetensors``: written by safetensors
    the first time, and from then on its tensors are copied into the file where they lie
    (through a mapping held for the run) as long as the bucket holds the same names,
    dtypes and shapes, which a model's pushes do. So the files' pages stay with the run
    and a push moves the weights once, at memory speed: writing a fresh file at every
    push took 0.29 s of a ~180M push, most of it getting fresh pages (on a virtual
    machine that reports free pages to its host, as docs/engines.md says, freed ones come
    back cold). The price: ``/dev/shm`` holds one copy of the pushed weights for the
    run. Servers read a bucket during its ``/update_weights`` and hold nothing of it
    after the push, so rewriting it at the next push is safe."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.dir: str | None = None
        self._slots: dict[int, tuple[list, dict[str, torch.Tensor]]] = {}
        """Per bucket index: its layout, and its tensors' views into the mapped file."""

    def _path(self, name: str) -> str:
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix=f"posttrain-push-{self.run_id}-",
                                        dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        return os.path.join(self.dir, name)

    def bucket(self, index: int, tensors: dict[str, torch.Tensor]) -> str:
        """Bucket ``index`` of this push as a safetensors file (see the class docstring):
        its path."""
        path = self._path(f"bucket-{index}.safetensors")
        layout = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
        slot = self._slots.get(index)
        if slot is None or slot[0] != layout:
            from safetensors.torch import save_file

            self._slots.pop(index, None)
            save_file(tensors, path)
            slot = self._slots[index] = (layout, _views(path, tensors))
        else:
            for name, t in tensors.items():
                slot[1][name].copy_(t)
        return path

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
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


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
