"""`python -m pdserve.bench.timeline` on synthetic logs: lines merged by rid, each process's stages placed on the
router's clock, segments that add up to the router's time to first byte, percentiles, and requests lacking a role's
line named instead of breaking the breakdown."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import timeline as bt

T0 = 1_700_000_000.0


def line(rid: str, role: str, arrival: float, **stages: float) -> dict:
    return {"rid": rid, "role": role, "arrival_unix": T0 + arrival, "stages": {"received": 0.0, **stages}}


def pd_request(rid: str, scale: float = 1.0) -> list[dict]:
    """Router at 0; prefill receives at 2 ms, computes 10-40 ms; decode receives at 1 ms, KV lands at 50 ms,
    first token at 60 ms, sent at 61 ms; the router has its first byte at 63 ms (times x scale)."""
    s = scale / 1000
    return [
        line(rid, "router", 0.0, dispatched_decode=1 * s, dispatched_prefill=1.5 * s, first_byte_prefill=45 * s,
             first_byte_decode=63 * s, finished=90 * s),
        line(rid, "prefill", 2 * s, prefill_chunk_start=8 * s, prefill_chunk_end=20 * s,
             **{"prefill_chunk_end#last": 38 * s}, kv_writes_landed=42 * s, finished=43 * s),
        line(rid, "decode", 1 * s, kv_landed=49 * s, first_token_emitted=59 * s, sent=60 * s, finished=88 * s),
    ]


def write_logs(tmp_path, records: list[dict]) -> list[str]:
    paths = []
    for role in ("router", "prefill", "decode", "regular"):
        mine = [r for r in records if r["role"] == role]
        if mine:
            path = tmp_path / f"{role}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in mine) + "\n")
            paths.append(str(path))
    return paths


def test_segments_are_placed_on_the_router_clock_and_add_up_to_first_byte():
    merged = bt.merge_by_rid(pd_request("a"))
    times = bt.segment_times(merged["a"], bt.PD_BREAKDOWN)
    expected_ms = {"router->prefill dispatch": 2, "prefill tokenize+queue": 8, "prefill forward": 30,
                   "KV writes (after forward)": 4, "kv_done to decode": 6, "decode commits first token": 10,
                   "decode detokenize+send": 1, "relay back": 2}
    # abs: a unix time near 1.7e9 s carries about 0.2 us
    assert times == pytest.approx({name: ms / 1000 for name, ms in expected_ms.items()}, abs=1e-6)
    assert sum(times.values()) == pytest.approx(0.063, abs=1e-6)


def test_a_single_chunk_prefill_ends_at_its_only_chunk_end():
    records = pd_request("a")
    del records[1]["stages"]["prefill_chunk_end#last"]
    times = bt.segment_times(bt.merge_by_rid(records)["a"], bt.PD_BREAKDOWN)
    assert times["prefill forward"] == pytest.approx(0.012, abs=1e-6)
    assert times["KV writes (after forward)"] == pytest.approx(0.022, abs=1e-6)


def test_percentiles_per_role_and_segment(tmp_path):
    records = [r for i in range(1, 101) for r in pd_request(f"r{i}", scale=i / 50)]
    report = bt.analyze(bt.read_records(write_logs(tmp_path, records)))
    first_byte = report["stages"]["router"]["first_byte_decode"]
    assert first_byte["count"] == 100 and first_byte["p50"] == pytest.approx(63 * 50.5 / 50)
    assert first_byte["p90"] == pytest.approx(63 * 90.1 / 50) and first_byte["p99"] == pytest.approx(63 * 99.01 / 50)
    pd = report["breakdown"]["pd"]
    assert pd["requests"] == 100 and pd["lacking"] == {}
    assert pd["segments"]["kv_done to decode"]["p50"] == pytest.approx(6 * 50.5 / 50, abs=1e-3)
    assert set(report["breakdown"]) == {"pd"}


def test_the_segments_means_add_up_to_the_totals_and_a_request_lacking_a_stage_is_left_out(tmp_path, capsys):
    """Every segment is taken over the same requests, so the printed means add up to the printed total's."""
    records = [r for i in range(1, 21) for r in pd_request(f"r{i}", scale=i / 7)]
    broken = pd_request("no-kv-landed")
    del broken[2]["stages"]["kv_landed"]
    assert bt.main(write_logs(tmp_path, records + broken)) == 0
    out = capsys.readouterr().out
    assert "note: 1 request(s) lack a boundary stage" in out
    report = bt.analyze(records + broken)["breakdown"]["pd"]
    segments = dict(report["segments"])
    total = segments.pop(bt.TOTAL)
    assert report["requests"] == total["count"] == 20 and all(s["count"] == 20 for s in segments.values())
    assert sum(s["mean"] for s in segments.values()) == pytest.approx(total["mean"], rel=1e-9)
    assert total["mean"] == pytest.approx(63 * (21 / 2) / 7, rel=1e-6)


def test_requests_lacking_a_role_are_counted_and_named(tmp_path, capsys):
    records = pd_request("full") + [r for r in pd_request("no-prefill") if r["role"] != "prefill"]
    records += [r for r in pd_request("server-only") if r["role"] == "decode"]
    paths = write_logs(tmp_path, records)
    out_json = tmp_path / "report.json"
    assert bt.main([*paths, "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert report["breakdown"]["pd"]["requests"] == 1
    assert report["breakdown"]["pd"]["lacking"] == {"prefill": 1, "prefill,router": 1}
    out = capsys.readouterr().out
    assert "note: 1 request(s) lack a prefill line; left out of this breakdown" in out
    assert "note: 1 request(s) lack a prefill,router line" in out
    assert "[decode]" in out and "client send -> first token (pd, 1 requests" in out


def test_colocated_breakdown_uses_the_workers_first_byte(tmp_path):
    router = line("c", "router", 0.0, dispatched=0.001, first_byte=0.030, finished=0.05)
    server = line("c", "regular", 0.002, prefill_chunk_start=0.003, prefill_chunk_end=0.020, sent=0.025)
    report = bt.analyze([router, server])
    segments = report["breakdown"]["colocated"]["segments"]
    assert {name: s["p50"] for name, s in segments.items()} == pytest.approx(
        {"router->server dispatch": 2.0, "tokenize+queue": 3.0, "prefill forward": 17.0,
         "sample+detokenize+send": 5.0, "relay back": 3.0, bt.TOTAL: 30.0}, abs=1e-3)


def test_server_lines_alone_give_stages_and_say_why_there_is_no_breakdown(tmp_path, capsys):
    paths = write_logs(tmp_path, [r for r in pd_request("a") if r["role"] != "router"])
    assert bt.main(paths) == 0
    out = capsys.readouterr().out
    assert "[prefill]" in out and "note: no breakdown without both the router's and the servers' lines" in out


def test_a_line_that_is_not_a_record_is_named(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(pd_request("a")[0]) + "\n{\"rid\": 1}\n")
    assert bt.main([str(path)]) == 1
    assert f"{path}:2: not a timeline record" in capsys.readouterr().err
