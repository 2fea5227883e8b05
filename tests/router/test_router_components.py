"""In-process unit tests: CLI parsing, circuit breaker, payload shaping, policies, and importing without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve_router.cli import parse_config
from pdserve_router.config import RouterConfig
from pdserve_router.payload import FirstEventMerger, bootstrap_fields, routing_key
from pdserve_router.policies import CacheAwarePolicy
from pdserve_router.workers import CircuitBreaker, Worker

ROUTER_DIR = Path(__file__).resolve().parents[2] / "router"  # `tools` (stub, bench) is importable from there


def test_import_does_not_pull_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import pdserve_router, pdserve_router.app, tools.bench, tools.stub\n"
            "from pdserve_router.app import create_app; from pdserve_router.cli import parse_config\n"
            "create_app(parse_config(['--decode', 'http://127.0.0.1:1']))\n"
            "assert sys.modules['torch'] is None\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROUTER_DIR)
    assert result.returncode == 0, result.stderr


def test_cli_bootstrap_ports_broadcast_or_one_per_prefill():
    config = parse_config(["--prefill", "http://a:1", "http://b:2", "--decode", "http://c:3"])
    assert config.mode == "pd" and config.bootstrap_ports == (8998, 8998) and config.host == "127.0.0.1"
    config = parse_config(["--prefill", "http://a:1", "http://b:2", "--prefill-bootstrap-ports", "7", "8"])
    assert config.bootstrap_ports == (7, 8)
    with pytest.raises(SystemExit):
        parse_config(["--prefill", "http://a:1", "http://b:2", "--prefill-bootstrap-ports", "7", "8", "9"])
    with pytest.raises(SystemExit):
        parse_config(["--worker", "http://a:1", "--decode", "http://b:2"])
    assert parse_config(["--worker", "http://a:1", "--policy", "least_load"]).mode == "regular"


def test_bootstrap_host_is_ipv6_safe():
    breaker = CircuitBreaker(1, 1, 1.0)
    prefill = Worker("http://[::1]:30000/", "prefill", breaker, bootstrap_port=8998)
    assert prefill.url == "http://[::1]:30000" and prefill.bootstrap_host == "[::1]"
    body = {"text": "x", **bootstrap_fields("/generate", prefill, None)}
    assert body["bootstrap_host"] == "[::1]" and body["bootstrap_port"] == 8998 and body["bootstrap_room"] < 2**63


def test_circuit_breaker_states():
    breaker = CircuitBreaker(failure_threshold=2, success_threshold=2, open_duration_s=10.0)
    breaker.record(False, now=0.0)
    assert breaker.allows(0.0)
    breaker.record(False, now=1.0)
    assert breaker.state == "open" and not breaker.allows(5.0)
    assert breaker.allows(11.0) and breaker.state == "half_open"
    breaker.record(False, now=11.5)
    assert breaker.state == "open" and not breaker.allows(12.0)
    assert breaker.allows(22.0)
    breaker.record(True, now=22.1)
    assert breaker.state == "half_open"
    breaker.record(True, now=22.2)
    assert breaker.state == "closed"


def test_cache_aware_matches_token_ids_and_respects_the_threshold():
    config = RouterConfig(cache_block_chars=4, cache_threshold=0.5)
    workers = [Worker(f"http://w{i}:1", "decode", CircuitBreaker(5, 2, 1.0)) for i in range(2)]
    policy = CacheAwarePolicy(config)
    first = policy.select(workers, list(range(16)))
    assert all(policy.select(workers, list(range(16)) + [99, i]) is first for i in range(5))
    first.in_flight = 1  # a mostly new prompt ignores a short shared prefix and goes to the less loaded worker
    assert policy.select(workers, list(range(4)) + list(range(100, 116))) is not first


@pytest.mark.parametrize("prompt", [[[[[]]]], [[1, [2]]], [1, "a"], [True, 2], {"a": 1}, 3])
def test_a_malformed_prompt_has_no_routing_key(prompt):
    """The router still forwards it (the server answers the 400); hashing it must not fail first."""
    assert routing_key("/generate", {"text": prompt}) is None
    assert routing_key("/v1/completions", {"prompt": prompt}) is None


def test_first_event_merger_handles_split_chunks():
    prefill = {0: {"meta_info": {"input_token_logprobs": [[-1.0, 5, None]]}}}
    merger = FirstEventMerger(prefill)
    stream = b'data: {"index": 0, "meta_info": {}}\n\ndata: {"index": 0, "meta_info": {}}\n\ndata: [DONE]\n\n'
    out = b"".join(merger.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + merger.flush()
    events = [json.loads(e[6:]) for e in out.decode().split("\n\n") if e.startswith("data: {")]
    assert events[0]["meta_info"]["input_token_logprobs"] == [[-1.0, 5, None]]
    assert events[1]["meta_info"] == {} and out.endswith(b"data: [DONE]\n\n")


def test_batch_size_counts_every_completion_item():
    from pdserve_router.payload import batch_size

    assert batch_size("/v1/completions", {"prompt": "a"}) is None
    assert batch_size("/v1/completions", {"prompt": [1, 2, 3]}) is None  # one prompt of token ids
    assert batch_size("/v1/completions", {"prompt": ["a", "b", "c"]}) == 3
    assert batch_size("/v1/completions", {"prompt": [[1], [2]], "n": 2}) == 4
    assert batch_size("/v1/chat/completions", {"messages": [], "n": 2}) == 2


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/generate", {"sampling_params": {"max_new_tokens": 0}}, True),
    ("/generate", {"max_new_tokens": 0}, True),
    ("/generate", {"max_new_tokens": 0, "sampling_params": {"max_new_tokens": 3}}, False),  # the nested one wins
    ("/generate", {"sampling_params": [{"max_new_tokens": 0}, {"max_new_tokens": 1}]}, False),
    ("/generate", {"sampling_params": {"max_new_tokens": False}}, False),
    ("/generate", {}, False),
    ("/v1/completions", {"max_tokens": 0}, True),
    ("/v1/chat/completions", {"max_tokens": 5, "max_completion_tokens": 0}, True),
    ("/v1/chat/completions", {"max_tokens": 0, "max_completion_tokens": 5}, False),
])
def test_prompt_only_requests_are_those_for_no_new_token(path, body, expected):
    from pdserve_router.payload import prompt_only

    assert prompt_only(path, body) is expected


def test_encode_body_appends_fields_to_the_client_bytes():
    from pdserve_router.payload import encode_body, spliceable

    raw = b'{"text": "h\\u00e9", "n": 1.50, "sampling_params": {"max_new_tokens": 4}}\n'
    body = json.loads(raw)
    assert spliceable(raw)
    out = encode_body(raw, body, {"bootstrap_room": 7, "rid": "a"})
    assert out.startswith(raw.rstrip()[:-1]) and json.loads(out) == {**body, "bootstrap_room": 7, "rid": "a"}
    assert encode_body(raw, body, {}) is raw  # nothing to add: forwarded as sent
    assert json.loads(encode_body(b"{}", {}, {"rid": "a"})) == {"rid": "a"}
    # a field the client set itself is replaced, not duplicated: the body is re-encoded
    out = encode_body(b'{"rid": "mine", "x": 1}', {"rid": "mine", "x": 1}, {"rid": "mine.r1"})
    assert out.count(b'"rid"') == 1 and json.loads(out) == {"rid": "mine.r1", "x": 1}
    assert json.loads(encode_body(None, {"x": 1}, {"rid": "a"})) == {"x": 1, "rid": "a"}
    for other in ('{"a": 1}'.encode("utf-16"), '{"a": 1}'.encode("utf-16-le"), b"\xef\xbb\xbf{}"):
        assert not spliceable(other)


def test_event_loop_choice(monkeypatch):
    import asyncio

    from pdserve_router.app import loop_name, new_event_loop
    from pdserve_router.config import ConfigError

    loop = new_event_loop("asyncio")
    assert loop_name(loop) == "asyncio" and isinstance(loop, asyncio.BaseEventLoop)
    loop.close()
    try:
        import uvloop  # noqa: F401
    except ImportError:
        have_uvloop = False
    else:
        have_uvloop = True
    loop = new_event_loop("auto")
    assert loop_name(loop) == ("uvloop" if have_uvloop else "asyncio")
    loop.close()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    loop = new_event_loop("auto")
    assert loop_name(loop) == "asyncio"
    loop.close()
    with pytest.raises(ConfigError, match="pdserve-router\\[fast\\]"):
        new_event_loop("uvloop")
    with pytest.raises(SystemExit):
        parse_config(["--event-loop", "tokio"])


def test_required_uvloop_that_is_missing_exits_with_a_clear_message():
    code = ("import sys; sys.modules['uvloop'] = None\n"
            "from pdserve_router.cli import main; main(['--decode', 'http://127.0.0.1:1', '--event-loop', 'uvloop'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "uvloop is not installed" in result.stderr
