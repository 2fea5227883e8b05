"""Fixtures for the benchmark tests: the tiny model (its tokenizer builds exact-length prompts) and, for the
end-to-end tests, a colocated server and a tcp PD pair behind a router: the session's shared servers
(tests/conftest.py `shared_servers`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def deployments(shared_servers) -> dict:
    return {"colocated": shared_servers["colocated"], "pd": shared_servers["tcp"]}
