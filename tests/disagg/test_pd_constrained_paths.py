"""Constrained decoding on the PD paths the end-to-end tests do not reach: a grammar request the decode server
prefills itself (conditional disaggregation), a grammar request that hits the decode-side radix cache, a grammar
that compiles on one side only (either side's failure reaches the other at once), and outputs cut by `length` (valid
prefixes of the grammar).
In-process schedulers over the tcp backend (tests/disagg/test_pd_schedulers.py)."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import jsonschema
import pytest
from test_pd_schedulers import engine_args, make_pair, run

from pdserve.config import ServerArgs
from pdserve.constrained.compiler import GrammarSpec
from pdserve.disagg.factory import create_scheduler
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.request import Req

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["a", "b", "c"]}}, "required": ["id", "tag"]}
CUT_SCHEMA = {"type": "array", "items": SCHEMA, "minItems": 3, "maxItems": 5}  # outputs cut by `length`


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def compile_schemas(*scheds) -> None:
    """The file's schemas compiled before any request for them, however long that takes: a first compile also
    builds the tokenizer's tables, and on a loaded machine it outlasted --grammar-compile-timeout-s (30 s: the
    reference run of the first test ended in a 400 about 1 run in 8)."""
    for sched in scheds:
        for schema in (SCHEMA, CUT_SCHEMA):
            sched.grammar_queue.compile_untimed(GrammarSpec("json_schema", json.dumps(schema)))


@pytest.fixture(scope="module")
def colocated(model):
    sched = create_scheduler(ServerArgs(**engine_args(model, disaggregation_transfer_backend="auto")))
    compile_schemas(sched)
    yield sched
    sched.close()


@pytest.fixture(scope="module")
def pair(model):
    prefill, decode, port = make_pair(model, disaggregation_decode_enable_radix_cache=True)
    compile_schemas(prefill, decode)
    yield prefill, decode, port
    prefill.close()
    decode.close()


def constrained(n: int, schema: dict = SCHEMA) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, json_schema=json.dumps(schema))


def req(rid: str, ids: list[int], params: SamplingParams, port: int | None = None, room: int | None = None) -> Req:
    bootstrap = {} if port is None else dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room)
    return Req(rid=rid, input_ids=list(ids), sampling_params=params, **bootstrap)


def colocated_run(sched, rid: str, ids: list[int], params: SamplingParams) -> dict:
    sched.add_request(req(rid, ids, params))
    got = run([sched])[(0, rid)]
    assert got["finish"]["type"] in ("stop", "length"), got  # the reference itself must have been served
    return got


def serve_pd(pair, rid: str, ids: list[int], params: SamplingParams, room: int) -> dict:
    prefill, decode, port = pair
    for s in (prefill, decode):
        s.add_request(req(rid, ids, params, port, room))
    return run([prefill, decode])[(1, rid)]


def text_of(sched, ids: list[int]) -> str:
    return sched.grammar_queue.load_tokenizer().decode(ids, skip_special_tokens=True)  # the EOS the grammar ends with


def assert_valid_prefix(sched, schema: dict, ids: list[int]) -> None:
    """A fresh matcher of the grammar `sched` compiled for `schema` accepts every output token, in order."""
    import xgrammar

    compiled = sched.grammar_queue.compiler.cache[GrammarSpec("json_schema", json.dumps(schema))].result(timeout=30)
    matcher = xgrammar.GrammarMatcher(compiled)
    assert ids and [matcher.accept_token(t) for t in ids] == [True] * len(ids), ids


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(n)]


def test_a_local_prefill_on_the_decode_with_a_json_schema_equals_colocated(pair, colocated):
    """Conditional disaggregation: no bootstrap fields, so the decode server prefills (in 2 chunks) and decodes
    under the grammar itself; a remote constrained request runs beside it."""
    prefill, decode, port = pair
    local, remote = prompt(1, 50), prompt(2, 20)
    expected = {rid: colocated_run(colocated, rid, ids, constrained(40))["ids"]
                for rid, ids in (("local", local), ("remote", remote))}
    local_before = decode.role.num_local_prefills
    for s in (prefill, decode):
        s.add_request(req("remote", remote, constrained(40), port, room=100))
    decode.add_request(req("local", local, constrained(40)))
    outs = run([prefill, decode])
    for rid in ("local", "remote"):
        assert outs[(1, rid)]["ids"] == expected[rid], rid
        assert outs[(1, rid)]["finish"]["type"] == "stop"
        jsonschema.validate(json.loads(text_of(decode, outs[(1, rid)]["ids"])), SCHEMA)
    assert (0, "local") not in outs and decode.role.num_local_prefills == local_before + 1
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()


def test_a_constrained_request_hitting_the_decode_radix_cache_equals_colocated(pair, colocated):
    """Turn 2 shares turn 1's 40-token prompt: the decode serves it from its own cache, under a fresh matcher."""
    first = prompt(3, 40)
    second = first + prompt(4, 9)
    got1 = serve_pd(pair, "turn1", first, constrained(40), room=200)
    got2 = serve_pd(pair, "turn2", second, constrained(40), room=201)
    assert got1["ids"] == colocated_run(colocated, "turn1", first, constrained(40))["ids"]
    assert got2["ids"] == colocated_run(colocated, "turn2", second, constrained(40))["ids"]
    assert got2["cached_tokens"] >= 40
    prefill, decode, _ = pair
    for got in (got1, got2):
        assert got["finish"]["type"] == "stop", got
        jsonschema.validate(json.loads(text_of(decode, got["ids"])), SCHEMA)
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()


def test_outputs_cut_by_length_are_prefixes_the_grammar_accepts(pair, colocated):
    schema = CUT_SCHEMA
    for n in (1, 2, 7):
        ids = prompt(10 + n, 30)
        local = colocated_run(colocated, f"cut{n}", ids, constrained(n, schema))
        through_pd = serve_pd(pair, f"cut{n}", ids, constrained(n, schema), room=300 + n)
        assert local["finish"]["type"] == through_pd["finish"]["type"] == "length"
        assert len(local["ids"]) == n and through_pd["ids"] == local["ids"]
        assert_valid_prefix(colocated, schema, local["ids"])
        assert_valid_prefix(pair[1], schema, through_pd["ids"])


def make_compiles_time_out(sched, monkeypatch) -> None:
    """`sched` gives a grammar 0.05 s to compile, and those starting with "slow" take 0.5 s."""
    queue = sched.grammar_queue
    monkeypatch.setattr(queue, "args", queue.args.replace(grammar_compile_timeout_s=0.05))
    compile_ = queue._compiler().compile

    def slow_compile(spec):
        if spec.text.startswith("slow"):
            time.sleep(0.5)
        return compile_(spec)

    monkeypatch.setattr(queue.compiler, "compile", slow_compile)


@pytest.mark.parametrize("slow_side", [1, 0], ids=["decode", "prefill"])
def test_a_compile_timing_out_on_one_side_only_fails_cleanly_and_pd_keeps_serving(model, monkeypatch, slow_side):
    """One side compiles the grammar, the other's compile outlasts its --grammar-compile-timeout-s: that side
    answers 400 at once, the other gives the request up at once, with the same 400 (the failing side's word reaches
    it over the control channel) or when the router aborts it; both pools end free, and the pair serves the next
    constrained request."""
    prefill, decode, port = make_pair(model, disaggregation_bootstrap_timeout=1.0)
    scheds = [prefill, decode]
    slow, other = scheds[slow_side], scheds[1 - slow_side]
    try:
        make_compiles_time_out(slow, monkeypatch)
        for rid, room, router_aborts in (("alone", 400, False), ("aborted", 401, True)):
            # a regex of its own: a compile that timed out still ends, and the next request would find it cached
            params = SamplingParams(temperature=0, max_tokens=8, regex=f"slow{rid}[0-9]")
            started = time.monotonic()
            for s in scheds:
                s.add_request(req(rid, prompt(5, 20), params, port, room))
            finish = None
            while finish is None:
                assert time.monotonic() - started < 5, "the slow side never answered"
                other.step()
                finish = next((o.finish_reason for o in slow.step() if o.rid == rid and o.finish_reason), None)
            assert finish.get("status_code") == 400 and "did not compile within 0.05 s" in finish["message"], finish
            if router_aborts:
                other.abort_request(rid)
            outs = run(scheds, timeout=10)
            other_finish = outs[(1 - slow_side, rid)]["finish"]
            assert other_finish["type"] == "abort"
            assert router_aborts or other_finish["status_code"] == 400, other_finish
            assert time.monotonic() - started < 5
            assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
            assert not prefill.has_work() and not decode.has_work()
        monkeypatch.undo()  # the usual timeout: a first JSON schema compile may take longer than 0.05 s
        for s in scheds:  # and longer than the pair's 1 s bootstrap timeout on a busy machine: compiled before
            s.grammar_queue.compile_untimed(GrammarSpec("json_schema", json.dumps(SCHEMA)))
        got = serve_pd((prefill, decode, port), "next", prompt(6, 20), constrained(40), room=402)
        assert got["finish"]["type"] == "stop", got
        jsonschema.validate(json.loads(text_of(decode, got["ids"])), SCHEMA)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim-first", "failure-first"])
def test_a_compile_failing_on_the_prefill_ends_the_decodes_half_at_once(model, monkeypatch, claim_first):
    """Without a router: the prefill's `failed` answers the decode's claim, whether the claim came before the
    failure or after it; the decode ends with the prefill's 400 and its pages free, long before its 10 s timeout."""
    prefill, decode, port = make_pair(model)
    try:
        make_compiles_time_out(prefill, monkeypatch)
        params = SamplingParams(temperature=0, max_tokens=8, regex="slow[0-9]")
        started = time.monotonic()
        first, second = (decode, prefill) if claim_first else (prefill, decode)
        first.add_request(req("r", prompt(7, 20), params, port, 600))
        done = False
        while not done:  # the decode's claim is out, or the prefill's 400
            assert time.monotonic() - started < 5
            outs = first.step()
            claim = decode.role.link.handoffs.get(600)
            done = claim is not None and claim.dst_pages if claim_first else any(o.finish_reason for o in outs)
        second.add_request(req("r", prompt(7, 20), params, port, 600))
        outs = run([prefill, decode], timeout=10)
        finish = outs[(1, "r")]["finish"]
        assert finish["status_code"] == 400 and "did not compile within 0.05 s" in finish["message"], finish
        assert time.monotonic() - started < 4
        assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
        assert not prefill.has_work() and not decode.has_work()
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("failure_first", [True, False], ids=["failure-first", "request-first"])
def test_a_compile_failing_on_the_decode_ends_the_prefills_half_at_once(model, monkeypatch, failure_first):
    """Without a router: the decode's `abort` (with its 400 and cause) reaches the prefill whether the prefill has its
    request already (it waits for the claim) or not yet (the abort waits for it), long before the prefill's 30 s
    bootstrap timeout. Round 1 finds no route to the prefill on the decode (it looks it up for the refusal alone),
    round 2 the one round 1 found; both pools end free, and the pair serves a constrained request afterwards."""
    prefill, decode, port = make_pair(model, disaggregation_bootstrap_timeout=30.0)
    try:
        make_compiles_time_out(decode, monkeypatch)
        for room in (700, 701):
            params = SamplingParams(temperature=0, max_tokens=8, regex=f"slow{room}[0-9]")  # uncached on the decode
            started = time.monotonic()
            first, second = (decode, prefill) if failure_first else (prefill, decode)
            first.add_request(req("r", prompt(8, 20), params, port, room))
            finishes = {}
            while not (prefill.role.early_requests.aborts.items() if failure_first  # the decode's abort landed
                       else room in prefill.role.link.handoffs):  # the prefill's compile done, it waits for a claim
                assert time.monotonic() - started < 5
                for side, sched in enumerate((prefill, decode)):
                    finishes |= {side: o.finish_reason for o in sched.step() if o.finish_reason}
            second.add_request(req("r", prompt(8, 20), params, port, room))
            finishes |= {side: out["finish"] for (side, _), out in run([prefill, decode], timeout=10).items()}
            assert_refused_by_the_decode(prefill, decode, finishes)
            assert time.monotonic() - started < 4
        monkeypatch.undo()
        next_params = SamplingParams(temperature=0, max_tokens=8, regex="[0-9]{3}")
        got = serve_pd((prefill, decode, port), "next", prompt(9, 20), next_params, room=702)
        assert got["finish"]["type"] == "stop" and re.fullmatch("[0-9]{3}", text_of(decode, got["ids"])), got
    finally:
        prefill.close()
        decode.close()


def test_a_compile_failing_on_the_decode_ends_the_prefills_half_while_its_compile_still_runs(model, monkeypatch):
    """The decode's abort reaches a prefill whose own compile of the grammar has not ended: its request ends at once,
    not once compiled (the compile is held until the test has seen the prefill's answer)."""
    prefill, decode, port = make_pair(model, disaggregation_bootstrap_timeout=30.0)
    compile_done = threading.Event()
    try:
        make_compiles_time_out(decode, monkeypatch)
        compile_ = prefill.grammar_queue._compiler().compile
        monkeypatch.setattr(prefill.grammar_queue.compiler, "compile",
                            lambda spec: compile_done.wait(30) and compile_(spec))
        params = SamplingParams(temperature=0, max_tokens=8, regex="slow[0-9]")
        for s in (prefill, decode):
            s.add_request(req("r", prompt(8, 20), params, port, 710))
        finishes, started = {}, time.monotonic()
        while 0 not in finishes:
            assert time.monotonic() - started < 5, "the prefill's request waited for its compile"
            for side, sched in enumerate((prefill, decode)):
                finishes |= {side: o.finish_reason for o in sched.step() if o.finish_reason}
        assert prefill.grammar_queue.stats()["grammar_waiting"] == 0 and not compile_done.is_set()
        compile_done.set()
        finishes |= {side: out["finish"] for (side, _), out in run([prefill, decode], timeout=10).items()}
        assert_refused_by_the_decode(prefill, decode, finishes)
    finally:
        compile_done.set()
        prefill.close()
        decode.close()


def assert_refused_by_the_decode(prefill, decode, finishes: dict) -> None:
    """Both halves ended with the decode's 400 and its cause; nothing is held or kept on either side."""
    for side in (0, 1):
        assert finishes[side]["status_code"] == 400, finishes
        assert "did not compile within 0.05 s" in finishes[side]["message"], finishes
    assert "aborted by the decode server" in finishes[0]["message"]
    assert prefill.kv_pool_is_fully_free() and decode.kv_pool_is_fully_free()
    assert not prefill.has_work() and not decode.has_work()
    assert decode.role.routes.num_refusals() == 0 and not prefill.role.early_requests.aborts.items()
