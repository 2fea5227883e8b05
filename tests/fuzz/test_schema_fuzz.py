"""Hypothesis fuzzing of every route of a colocated server, a PD pair (each half directly) and the router: bodies
from the schema models' JSON schemas plus hostile variants. No answer is a 500 (other than a deliberate
502/503/504) or a non-JSON error, every request ends within its client timeout, no process dies, and afterwards
every server answers a normal request correctly with its KV pool fully free.

The default run is a fixed, derandomized subset; `-m fuzz_full` runs at least 1,000 requests per route family."""

from __future__ import annotations

import collections
import time

import pytest

pytest.importorskip("hypothesis_jsonschema")  # a test extra; the GPU image lacks it

from fuzz_util import Targets, assert_serves_correctly, problem, send  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from strategies import admin_requests, plausible_bodies, request_bodies  # noqa: E402

from pdserve.server.schemas import ChatCompletionRequest, CompletionRequest, GenerateReqInput

# the PD halves refuse every request that did not come through the router, so the others are drawn twice as often
TARGETS = ("colocated", "router", "prefill", "decode", "colocated", "router")
FAMILIES = {"/generate": GenerateReqInput, "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest}
FAST_EXAMPLES = 30
FULL_EXAMPLES = 1000
RUNS = [pytest.param(FAST_EXAMPLES, id="fast"), pytest.param(FULL_EXAMPLES, id="full", marks=pytest.mark.fuzz_full)]


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def run_fuzz(targets: Targets, requests: st.SearchStrategy, examples: int, family: str) -> None:
    """Send every drawn (target, method, path, body) and fail on the first bad answer; print the status counts."""
    statuses: collections.Counter = collections.Counter()
    started, waited = time.monotonic(), 0.0

    @fuzz_settings(examples)
    @given(st.sampled_from(TARGETS), requests)
    def one_request(target: str, request: tuple[str, str, bytes | None]) -> None:
        method, path, body = request
        nonlocal waited
        sent = time.monotonic()
        answer = send(targets.by_name(target).url, method, path, body)
        waited += time.monotonic() - sent
        statuses[answer.status] += 1
        assert problem(answer) is None, f"{target} {method} {path} {body[:300] if body else body!r}: {problem(answer)}"

    one_request()
    print(f"\nfuzz {family}: {sum(statuses.values())} requests in {time.monotonic() - started:.0f} s "
          f"({waited:.0f} s waiting for answers), statuses {dict(sorted(statuses.items()))}")


@pytest.fixture(scope="module")
def served_model(targets) -> str:
    return targets.colocated.get("/v1/models").json()["data"][0]["id"]


@pytest.mark.parametrize("examples", RUNS)
@pytest.mark.parametrize("route", FAMILIES)
def test_generation_routes(targets, served_model, route, examples):
    model = FAMILIES[route]
    bodies = request_bodies(model, None if model is GenerateReqInput else served_model,
                            plausible_bodies(route, served_model))
    run_fuzz(targets, bodies.map(lambda body: ("POST", route, body)), examples, route)


@pytest.mark.parametrize("examples", RUNS)
def test_admin_routes(targets, examples):
    run_fuzz(targets, admin_requests(), examples, "admin")


@pytest.mark.parametrize("examples", RUNS)
def test_servers_serve_correctly_afterwards(targets, examples):
    assert_serves_correctly(targets)
