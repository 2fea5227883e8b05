"""The serving benchmark's statistics (SGLang bench_serving's definitions) and its goodput search."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from pdserve.bench.client import ClientConfig, RequestResult, TokenClock, new_tokens, request_body
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.stats import Slo, distribution, find_goodput, summarize


def result(ttft: float, latency: float, output_len: int, itl=(), success=True, aborted=False,
           error="") -> RequestResult:
    return RequestResult(input_len=10, expected_output_len=output_len, success=success, aborted=aborted, error=error,
                         output_len=output_len, ttft=ttft, latency=latency, itl=list(itl))


def test_percentiles_interpolate_linearly_in_milliseconds():
    dist = distribution([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert dist["mean"] == pytest.approx(50.5)
    assert dist["p50"] == pytest.approx(50.5)
    assert dist["p90"] == pytest.approx(90.1)
    assert dist["p99"] == pytest.approx(99.01)
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_excludes_the_first_token_and_is_undefined_for_one_token():
    assert result(ttft=0.2, latency=1.2, output_len=11).tpot == pytest.approx(0.1)
    assert result(ttft=0.2, latency=0.2, output_len=1).tpot is None


def test_a_chunk_of_k_tokens_adds_k_equal_inter_token_latencies(monkeypatch):
    now = iter([10.5, 10.8, 11.4])
    monkeypatch.setattr(time, "perf_counter", lambda: next(now))
    res = RequestResult(5, 6)
    clock = TokenClock(res, sent_at=10.0)
    clock.tokens(1)  # first token at 10.5: TTFT 0.5
    clock.tokens(2)  # two tokens 0.3 s later: two gaps of 0.15
    clock.tokens(0)  # an event without a new token changes nothing
    clock.tokens(3)  # three tokens 0.6 s later: three gaps of 0.2
    assert res.ttft == pytest.approx(0.5)
    assert res.itl == pytest.approx([0.15, 0.15, 0.2, 0.2, 0.2])
    assert res.output_len == 6


def test_token_counts_per_backend_event():
    assert new_tokens("pdserve", {"meta_info": {"completion_tokens": 7}}, seen=4) == 3
    assert new_tokens("openai", {"choices": [{"text": "ab"}]}, seen=4) == 1
    assert new_tokens("openai", {"choices": [], "usage": {"completion_tokens": 9}}, seen=4) == 0
    assert new_tokens("openai-chat", {"choices": [{"delta": {"role": "assistant"}}]}, seen=0) == 0
    assert new_tokens("openai-chat", {"choices": [{"delta": {"content": "x"}}]}, seen=0) == 1


def test_summary_counts_errors_and_aborts_and_judges_the_slo():
    results = [result(0.1, 1.1, 11, itl=[0.1] * 10),  # TTFT 100 ms, TPOT 100 ms
               result(0.5, 0.7, 3, itl=[0.1, 0.1]),  # TTFT 500 ms: misses the TTFT SLO
               result(0.1, 3.1, 11, itl=[0.3] * 10),  # TPOT 300 ms: misses the TPOT SLO
               result(0.05, 0.05, 1),  # one token: no TPOT, inside
               result(0, 0, 0, success=False, error="HTTP 503: busy"),
               result(0, 0, 0, success=False, error="timeout after 5 s"),
               result(0.1, 0.2, 2, success=False, aborted=True)]
    summary = summarize(results, duration_s=2.0, slo=Slo(ttft_ms=200, tpot_ms=150))
    assert (summary["requests"], summary["completed"], summary["errors"], summary["aborted"]) == (7, 4, 2, 1)
    assert summary["error_kinds"] == {"HTTP 503": 1, "timeout after 5 s": 1}
    assert summary["slo_attainment"] == pytest.approx(2 / 6)  # errors count as misses, aborts are not judged
    assert summary["good_request_throughput"] == pytest.approx(1.0)
    assert summary["request_throughput"] == pytest.approx(2.0)
    assert summary["output_tokens"] == 26
    assert summary["output_throughput"] == pytest.approx(13.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(np.mean([100, 100, 300]))
    assert summary["itl_ms"]["p50"] == pytest.approx(100)
    assert summary["e2e_ms"]["p50"] == pytest.approx(np.median([1100, 700, 3100, 50]))


def synthetic_attainment(threshold: float):
    """A fake deployment: every request meets the SLO below `threshold` req/s, latency explodes above it."""
    measured = []

    def measure(rate: float) -> float:
        measured.append(rate)
        return 1.0 if rate <= threshold else max(0.0, 0.9 - (rate - threshold))

    return measure, measured


@pytest.mark.parametrize("threshold", [3.7, 5.2])
def test_goodput_search_finds_the_known_threshold(threshold):
    measure, measured = synthetic_attainment(threshold)
    search = find_goodput(measure, rates=[4, 1, 2, 8, 16], bisect_steps=8)
    assert search.passing <= threshold < search.failing
    assert search.failing - search.passing <= 8 / 2 ** 8  # the first bracket, at most (4, 8], halved 8 times
    assert 16 not in measured  # rates above the first failing one are never run
    assert search.as_dict()["goodput_req_s"] == search.passing


def test_goodput_search_doubles_upwards_to_its_cap_and_reports_a_lower_bound():
    measure, measured = synthetic_attainment(math.inf)
    search = find_goodput(measure, rates=[2, 1], bisect_steps=5, max_rate=10)
    assert measured == [1, 2, 4, 8]
    assert search.as_dict()["lower_bound_only"] and search.passing == 8


def test_goodput_search_goes_upwards_past_the_given_rates_until_one_fails():
    measure, measured = synthetic_attainment(5.2)
    search = find_goodput(measure, rates=[1, 2], bisect_steps=1, max_rate=64)
    assert measured == [1, 2, 4, 8, 6]
    assert (search.passing, search.failing) == (4, 6)


def test_goodput_search_never_goes_below_the_lowest_rate():
    measure, measured = synthetic_attainment(0.4)
    search = find_goodput(measure, rates=[2, 4], bisect_steps=3)
    assert measured == [2]
    assert search.as_dict()["goodput_req_s"] is None and search.failing == 2


def test_slo_misses_name_the_term_each_request_missed():
    results = [result(0.5, 0.7, 3),  # TTFT 500 ms
               result(0.1, 3.1, 11),  # TPOT 300 ms
               result(0.5, 3.5, 11),  # both
               result(0, 0, 0, success=False, error="HTTP 400: the prompt has 600 tokens")]
    summary = summarize(results, duration_s=1.0, slo=Slo(ttft_ms=200, tpot_ms=150))
    assert summary["slo_misses"] == {"ttft": 2, "tpot": 2, "failed": 1}
    assert summary["slo_attainment"] == 0
    assert summary["first_errors"] == {"HTTP 400": "HTTP 400: the prompt has 600 tokens"}


def test_extra_body_sampling_params_merge_into_the_requests_own():
    extra = {"sampling_params": {"json_schema": "{}", "max_new_tokens": 3}, "rid": "r1"}
    route, body = request_body(ClientConfig("pdserve", "http://x", extra_body=extra), BenchRequest("hi", 1, 8))
    assert route == "/generate" and body["rid"] == "r1" and body["stream"] is True
    assert body["sampling_params"] == {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                                       "json_schema": "{}"}
    config = ClientConfig("openai-chat", "http://x", "m", extra_body={"response_format": {"type": "json_object"}})
    _, chat = request_body(config, BenchRequest("hi", 1, 8))
    assert chat["response_format"] == {"type": "json_object"} and chat["max_tokens"] == 8
