from __future__ import annotations

import http.server
import json
import threading
import urllib.request

import pytest

from pdserve.disagg.bootstrap import (
    BootstrapError,
    BootstrapServer,
    IncompatiblePeer,
    PrefillRankInfo,
    bootstrap_healthy,
    check_compatible,
    describe,
    fetch_prefill_route,
    register_prefill_rank,
)

LAYOUT = {"num_layers": 4, "num_kv_heads": 2, "total_kv_heads": 4, "head_dim": 64, "page_size": 16, "num_pages": 100,
          "dtype": "bfloat16"}  # a rank of TP 2


def rank_info(rank: int, **changes) -> PrefillRankInfo:
    base = dict(rank=rank, control_endpoint=f"127.0.0.1:{7000 + rank}", transfer_session=f"127.0.0.1:{9000 + rank}",
                transfer_backend="tcp", kv_layout=LAYOUT, model="tiny-llama", tp_size=2)
    base.update(changes)
    return PrefillRankInfo(**base)


@pytest.fixture
def server():
    srv = BootstrapServer("127.0.0.1", 0, expected_ranks=2)
    try:
        yield srv
    finally:
        srv.close()


def test_not_ready_until_all_ranks_registered(server):
    assert bootstrap_healthy(server.address)
    with pytest.raises(BootstrapError, match="503 not ready: 0/2"):
        fetch_prefill_route(server.address, timeout_s=0.3)
    register_prefill_rank(server.address, rank_info(1))
    with pytest.raises(BootstrapError, match="1/2"):
        fetch_prefill_route(server.address, timeout_s=0.3)
    register_prefill_rank(server.address, rank_info(0))
    route = fetch_prefill_route(server.address, timeout_s=5)
    assert route["model"] == "tiny-llama" and route["tp_size"] == 2 and route["kv_layout"] == LAYOUT
    assert route["ranks"]["1"]["transfer_session"] == "127.0.0.1:9001"
    assert fetch_prefill_route(server.address, rank=0)["control_endpoint"] == "127.0.0.1:7000"
    with pytest.raises(BootstrapError, match="404"):
        fetch_prefill_route(server.address, rank=5, timeout_s=1)


def test_reregistration_replaces_the_rank(server):
    register_prefill_rank(server.address, rank_info(0))
    register_prefill_rank(server.address, rank_info(1))
    register_prefill_rank(server.address, rank_info(1, transfer_session="127.0.0.1:9999"))
    assert fetch_prefill_route(server.address, rank=1)["transfer_session"] == "127.0.0.1:9999"


def test_bad_registrations_are_refused(server):
    with pytest.raises(BootstrapError, match="outside 0..1"):
        register_prefill_rank(server.address, rank_info(2))
    register_prefill_rank(server.address, rank_info(0))
    with pytest.raises(BootstrapError, match="409 page_size mismatch: rank 0 has 16, rank 1 has 32"):
        register_prefill_rank(server.address, rank_info(1, kv_layout={**LAYOUT, "page_size": 32}))
    req = urllib.request.Request(f"http://{server.address}/route", data=json.dumps({"rank": "0"}).encode(), method="PUT")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 400


def test_unreachable_server_times_out():
    with pytest.raises(BootstrapError, match="unreachable"):
        fetch_prefill_route("127.0.0.1:1", timeout_s=0.3)


def test_a_last_attempt_that_times_out_reports_the_last_answer():
    """A bootstrap server that said "not ready" and then stalls (a loaded prefill's thread): the error is its
    answer, not the stalled attempt's timeout."""
    release = threading.Event()

    class NotReadyThenStalled(http.server.BaseHTTPRequestHandler):
        answered = False

        def do_GET(self):
            if NotReadyThenStalled.answered:
                release.wait(10)
            NotReadyThenStalled.answered = True
            body = b"not ready: 0/2"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotReadyThenStalled)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(BootstrapError, match="503 not ready: 0/2"):
            fetch_prefill_route(f"127.0.0.1:{server.server_address[1]}", timeout_s=0.5)
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize(
    "field, prefill_value, decode_value, message",
    [
        ("page_size", 16, 32, "page_size mismatch: prefill has 16, decode has 32"),
        ("dtype", "bfloat16", "float16", "dtype mismatch: prefill has bfloat16, decode has float16"),
        ("num_layers", 4, 5, "num_layers mismatch: prefill has 4, decode has 5"),
        ("total_kv_heads", 4, 8, "total_kv_heads mismatch: prefill has 4, decode has 8"),
        ("head_dim", 64, 128, "head_dim mismatch"),
    ],
)
def test_layout_mismatch_names_both_values(field, prefill_value, decode_value, message):
    prefill = describe(rank_info(0, kv_layout={**LAYOUT, field: prefill_value}))
    decode = describe(rank_info(0, kv_layout={**LAYOUT, field: decode_value}))
    with pytest.raises(IncompatiblePeer, match=message):
        check_compatible(prefill, decode)


def test_topology_mismatch_and_page_count_freedom():
    prefill = describe(rank_info(0))
    check_compatible(prefill, describe(rank_info(0, kv_layout={**LAYOUT, "num_pages": 7})))
    with pytest.raises(IncompatiblePeer, match="model mismatch: prefill has 'tiny-llama', decode has 'other'"):
        check_compatible(prefill, describe(rank_info(0, model="other")))
    with pytest.raises(IncompatiblePeer, match="transfer_backend mismatch"):
        check_compatible(prefill, describe(rank_info(0, transfer_backend="mooncake")))


def test_different_tp_sizes_pair_when_each_side_holds_its_share_of_the_heads():
    prefill = describe(rank_info(0))  # TP 2, 2 of 4 heads per rank
    check_compatible(prefill, describe(rank_info(0, tp_size=1, kv_layout={**LAYOUT, "num_kv_heads": 4})))
    check_compatible(prefill, describe(rank_info(0, tp_size=8, kv_layout={**LAYOUT, "num_kv_heads": 1})))  # replicated
    with pytest.raises(IncompatiblePeer, match=r"decode's KV heads do not map to its ranks: 2 KV heads per rank, but "
                                               r"TP 1 of 4 heads gives 4 \(prefill: TP 2 x \[4 layers, 2 of 4 KV heads "
                                               r"x 64, bfloat16, page 16\]; decode: TP 1 x \[4 layers, 2 of 4"):
        check_compatible(prefill, describe(rank_info(0, tp_size=1)))
    with pytest.raises(IncompatiblePeer, match="4 KV heads cannot be split over or replicated on 3 ranks"):
        check_compatible(prefill, describe(rank_info(0, tp_size=3, kv_layout={**LAYOUT, "num_kv_heads": 1})))


def test_port_in_use_is_a_clear_error(server):
    with pytest.raises(BootstrapError, match="could not start"):
        BootstrapServer("127.0.0.1", server.port)
