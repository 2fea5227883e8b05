from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (see pyproject.toml) are skipped where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
