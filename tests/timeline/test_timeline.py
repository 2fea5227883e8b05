"""The request timeline record and its sink: first-mark and repeated-stage rules, the stage histogram, the JSON-lines
log (one valid line per request, from many threads at once), and importing it without torch."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from prometheus_client import CollectorRegistry, generate_latest

from pdserve import timeline as tl
from pdserve.timeline import RequestTimeline, TimelineSink


def timeline_at(arrival: float, role: str = "prefill", rid: str = "r1") -> RequestTimeline:
    return RequestTimeline(rid, role, arrival_unix=1_700_000_000.0, arrival_monotonic=arrival,
                           stages={tl.RECEIVED: 0.0})


def test_a_stage_keeps_its_first_mark_and_a_repeated_stage_its_last_too():
    timeline = timeline_at(100.0)
    timeline.mark(tl.QUEUED, now=100.5)
    timeline.mark(tl.QUEUED, now=101.0)
    for start in (101.0, 102.0, 103.0):
        timeline.mark(tl.PREFILL_CHUNK_START, now=start)
    timeline.mark(tl.PREFILL_CHUNK_END, now=101.5)
    assert timeline.stages == {tl.RECEIVED: 0.0, tl.QUEUED: 0.5, tl.PREFILL_CHUNK_START: 1.0,
                               "prefill_chunk_start#last": 3.0, tl.PREFILL_CHUNK_END: 1.5}


def test_begin_marks_received_at_arrival_and_stages_follow_on_the_monotonic_clock():
    timeline = RequestTimeline.begin("abc", "decode")
    timeline.mark(tl.PAGES_PREALLOCATED)
    timeline.mark(tl.FIRST_TOKEN_EMITTED)
    record = timeline.record()
    assert record["rid"] == "abc" and record["role"] == "decode" and record["arrival_unix"] > 1e9
    assert list(record["stages"]) == [tl.RECEIVED, tl.PAGES_PREALLOCATED, tl.FIRST_TOKEN_EMITTED]
    assert 0.0 == record["stages"][tl.RECEIVED] <= record["stages"][tl.PAGES_PREALLOCATED] \
        <= record["stages"][tl.FIRST_TOKEN_EMITTED] < 1.0


def test_sink_observes_every_stage_and_logs_one_line_per_request(tmp_path):
    registry, path = CollectorRegistry(), tmp_path / "prefill.jsonl"
    sink = TimelineSink(registry, str(path))
    timeline = timeline_at(10.0, rid="x")
    timeline.mark(tl.ADMITTED, now=10.25)
    timeline.mark(tl.FINISHED, now=12.0)
    sink.finish(timeline)
    sink.close()
    sink.close()  # twice is fine (shutdown paths may overlap)
    assert json.loads(path.read_text()) == {"rid": "x", "role": "prefill", "arrival_unix": 1_700_000_000.0,
                                            "stages": {"received": 0.0, "admitted": 0.25, "finished": 2.0}}
    text = generate_latest(registry).decode()
    assert 'pdserve_request_stage_seconds_count{role="prefill",stage="admitted"} 1.0' in text
    assert 'pdserve_request_stage_seconds_sum{role="prefill",stage="finished"} 2.0' in text
    assert 'pdserve_request_stage_seconds_bucket{le="0.0001",role="prefill",stage="received"} 1.0' in text


def test_sink_without_a_log_path_only_observes_and_finish_marks_finished(tmp_path):
    registry = CollectorRegistry()
    sink = TimelineSink(registry)
    timeline = RequestTimeline.begin("y", "decode")
    sink.finish(timeline)
    assert tl.FINISHED in timeline.stages and sink.log is None
    assert registry.get_sample_value("pdserve_request_stage_seconds_count",
                                     {"role": "decode", "stage": "finished"}) == 1.0


def test_concurrent_finishes_write_whole_lines(tmp_path):
    path = tmp_path / "decode.jsonl"
    sink = TimelineSink(CollectorRegistry(), str(path))

    def finish_many(thread: int) -> None:
        for i in range(200):
            sink.finish(RequestTimeline.begin(f"{thread}-{i}-" + "p" * 300, "decode"))

    threads = [threading.Thread(target=finish_many, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sink.close()
    rids = [json.loads(line)["rid"] for line in path.read_text().splitlines()]
    assert len(rids) == len(set(rids)) == 800


def test_import_does_not_pull_torch():
    code = "import sys; sys.modules['torch'] = None\nimport pdserve.timeline\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
