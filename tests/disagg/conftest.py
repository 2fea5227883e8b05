"""Fixtures of the KV transfer tests."""

from __future__ import annotations

import pytest

from pdserve.disagg.transfer import make_transfer_engine


@pytest.fixture
def sender():
    """A tcp transfer engine on the CPU, the sending side of a byte test."""
    engine = make_transfer_engine("tcp", "cpu", timeout_s=10)
    try:
        yield engine
    finally:
        engine.close()
