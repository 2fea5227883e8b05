"""PD with tiers: a prefix one prefill instance computed is reused from storage by another prefill instance,
and the decode output still equals HF."""

from __future__ import annotations

import time

from hicache_util import MAX_NEW, PAGE_SIZE, greedy, prompts

from pdserve.config import ServerArgs
from pdserve.ports import free_port
from pdserve.mem_cache.null_cache import NullPrefixCache
from pdserve.disagg.factory import create_scheduler
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.request import Req


def role_args(model: str, mode: str, storage_dir: str, **kw) -> ServerArgs:
    return ServerArgs(model_path=model, device="cpu", dtype="float32", page_size=PAGE_SIZE, max_total_tokens=1024,
                      disaggregation_mode=mode, disaggregation_transfer_backend="tcp", port=1,
                      enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=storage_dir,
                      hicache_storage_prefetch_policy="wait_complete", **kw)


def serve(prefill: Scheduler, decode: Scheduler, port: int, rid: str, ids: list[int], room: int):
    """One request through a prefill and a decode scheduler; (prefill's cached tokens, decode's output ids)."""
    for sched in (prefill, decode):
        sched.add_request(Req(rid=rid, input_ids=list(ids), sampling_params=greedy(), bootstrap_host="127.0.0.1",
                              bootstrap_port=port, bootstrap_room=room))
    cached, output, deadline = 0, [], time.monotonic() + 60
    while prefill.has_work() or decode.has_work():
        assert time.monotonic() < deadline, "the PD pair did not finish the request"
        cached = max([cached] + [o.cached_tokens for o in prefill.step()])
        output += [t for o in decode.step() for t in o.new_token_ids]
    return cached, output


def test_prefix_from_one_prefill_instance_is_reused_by_another(tiny_model, hf_greedy, tmp_path):
    ports = free_port(), free_port()
    first, second = (create_scheduler(role_args(tiny_model, "prefill", str(tmp_path), disaggregation_bootstrap_port=p))
                     for p in ports)
    decode = create_scheduler(role_args(tiny_model, "decode", str(tmp_path)))
    try:
        (base,) = prompts(48, seed=9)
        cached, output = serve(first, decode, ports[0], "a", base, room=1)
        assert cached == 0 and output == hf_greedy(base)
        assert first.radix.wait_for_writes(timeout=30)
        followup = base + [17, 18]
        cached, output = serve(second, decode, ports[1], "b", followup, room=2)
        assert cached == 48 and len(output) == MAX_NEW
        assert output == hf_greedy(followup)
        assert isinstance(decode.radix, NullPrefixCache)  # the decode role keeps no cache of its own
        for sched in (first, second, decode):
            assert sched.kv_pool_is_fully_free()
    finally:
        for sched in (first, second, decode):
            sched.close()
        first.radix.close()
        second.radix.close()
