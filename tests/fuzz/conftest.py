"""Fixtures for the fuzz suite: one colocated server and one tcp prefill + decode pair behind a router, real
processes on loopback: the session's shared servers (tests/conftest.py `shared_servers`, the colocated server with
--max-batch-items 4096), which the bench and PD tests use too."""

from __future__ import annotations

import pytest
from fuzz_util import Targets, generate_greedy


@pytest.fixture(scope="session")
def targets(shared_servers) -> Targets:
    colocated, pd = shared_servers["colocated"], shared_servers["tcp"]
    reference = generate_greedy(colocated)["text"]  # before any abuse
    return Targets(colocated, pd.prefill, pd.decode, pd.router, reference)
