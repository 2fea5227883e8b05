from __future__ import annotations

import pytest
import torch

from pdserve.tools.make_model import make_model


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (see pyproject.toml) are skipped where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class TinyModels(dict):
    """Folder of each random-weight preset (seed 0; the tiny ones, or an exact shape for GPU tests), built once,
    on first use."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, preset: str) -> str:
        self[preset] = str(make_model(preset, self.root / preset, seed=0))
        return self[preset]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> str:
    """The tiny qwen3 model most tests serve."""
    return tiny_models["qwen3-tiny"]
