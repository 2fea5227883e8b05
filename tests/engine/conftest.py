from __future__ import annotations

import pytest

from pdserve.tools.make_model import make_model

TINY_PRESETS = ("llama-tiny", "qwen2-tiny", "qwen3-tiny")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {p: str(make_model(p, root / p, seed=0)) for p in TINY_PRESETS}


@pytest.fixture(scope="session")
def qwen3_tiny(tiny_models) -> str:
    return tiny_models["qwen3-tiny"]
