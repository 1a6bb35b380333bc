"""Shared fixtures: one random tiny Llama with the byte tokenizer for the whole session."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from posttrain.builtin.build import init_model

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny") / "model"
    init_model(path, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=2)
    return str(path)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device; without one they are skipped, not failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
