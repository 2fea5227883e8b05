from __future__ import annotations

import pytest
from fp8_util import Fp8Models


@pytest.fixture(scope="session")
def fp8_models(tmp_path_factory) -> Fp8Models:
    return Fp8Models(tmp_path_factory.mktemp("fp8_models"))
