"""Shared fixtures: one random tiny Llama with the byte tokenizer for the whole session."""

from __future__ import annotations

import os
import tempfile

# MKL's matmuls may round differently with the memory alignment of their operands, which
# differs between a process that ran a whole run and one that resumed it; conditional
# numerical reproducibility makes them alignment-independent (read when MKL first runs, so
# set before torch is imported), which the bit-exact resume tests need.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest
import torch

# torch.compile caches its CPU kernels on disk keyed by the machine, not by
# ATEN_CPU_CAPABILITY: a run under another capability would load kernels built for the
# first one (seen: NaN log-probs under avx2 from kernels built for avx512). One cache per
# capability keeps the suite's runs under different kernels apart.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"posttrain-inductor-{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from posttrain.builtin.build import init_model

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny") / "model"
    init_model(path, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=2)
    return str(path)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (the fast tier's default): a worker per core this process may use, at most
    4. The tests run torch on one thread each (the fixture above), so on two cores two
    workers halve the tier; past four, each worker's imports and memory outweigh the
    gain."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device; without one they are skipped, not failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
