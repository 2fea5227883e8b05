"""The persistent decode batch: page-table patching, composition changes, and overlap of sampled batches."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.sampler import SamplingTensors
from pdserve.scheduler.decode_input_batch import DecodeInputBatch
from pdserve.scheduler.request import Req


def req(rid: str, pages: list[int], **params) -> Req:
    r = Req(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams(**params))
    r.pages = list(pages)
    return r


def table(batch: DecodeInputBatch) -> list[list[int]]:
    return batch.page_table.tolist()


def test_page_table_is_patched_and_widened_in_place_of_a_rebuild():
    a, b = req("a", [5]), req("b", [7, 8])
    batch = DecodeInputBatch([a, b], page_size=4, max_pages=16, device=torch.device("cpu"))
    assert table(batch) == [[5, 0], [7, 8]]
    a.pages.append(9)
    b.pages += [10, 11]  # past the table's width: it widens
    fb = batch.forward_batch([1, 2], [6, 13])
    assert batch.matches([a, b])
    assert [row[:3] for row in table(batch)] == [[5, 9, 0], [7, 8, 10]] and table(batch)[1][3] == 11
    assert fb.page_table is batch.page_table and fb.seq_lens.tolist() == [7, 14] and fb.prefix_lens_cpu == [6, 13]
    assert fb.out_cache_loc.tolist() == [9 * 4 + 2, 11 * 4 + 1] and fb.extend_lens_cpu == [1, 1]


def test_composition_or_replaced_pages_do_not_match():
    a, b = req("a", [5]), req("b", [7])
    batch = DecodeInputBatch([a, b], page_size=4, max_pages=16, device=torch.device("cpu"))
    assert batch.matches([a, b]) and not batch.matches([b, a]) and not batch.matches([a])
    b.pages = [7]  # retracted and re-admitted: a new list, possibly other pages
    assert not batch.matches([a, b])


def test_device_sampling_only_tracks_min_tokens_and_host_state():
    plain, pending = req("p", [1], temperature=0.7), req("m", [2], temperature=0.7, max_tokens=8, min_tokens=2)
    batch = DecodeInputBatch([plain, pending], page_size=4, max_pages=16, device=torch.device("cpu"))
    assert not batch.device_sampling_only()
    pending.output_ids += [4, 5]
    assert batch.device_sampling_only()
    for host_state in ({"temperature": 0.7, "seed": 3}, {"temperature": 0, "frequency_penalty": 1.0}):
        other = DecodeInputBatch([plain, req("h", [3], **host_state)], page_size=4, max_pages=16, device=torch.device("cpu"))
        assert not other.device_sampling_only()


def test_sampling_tensors_pack_every_parameter():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=40, top_p=0.9, min_p=0.1)]
    t = SamplingTensors.of(params, torch.device("cpu"))
    assert t.temperatures.tolist() == [0.0, 0.5] and t.top_ks.tolist() == [0, 40] and t.top_ks.dtype == torch.int64
    assert t.top_ps.tolist() == pytest.approx([1.0, 0.9]) and t.min_ps.tolist() == pytest.approx([0.0, 0.1])
    assert not t.all_greedy and t.any_filter


def new_llm(path: str, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=256, **kw)


@pytest.mark.parametrize("filters", [dict(top_p=0.9), {}])  # the Sampler after the forward; decode_tokens
def test_sampled_batches_overlap_and_draw_what_synchronous_decode_draws(tiny_model, filters):
    rng = random.Random(3)
    ps = [[rng.randrange(3, 900) for _ in range(rng.randrange(5, 40))] for _ in range(5)]
    sp = SamplingParams(temperature=0.8, max_tokens=14, ignore_eos=True, **filters)
    sync = new_llm(tiny_model, disable_overlap_schedule=True)
    sched = new_llm(tiny_model).scheduler
    for i, p in enumerate(ps):
        sched.add_request(Req(rid=f"s{i}", input_ids=p, sampling_params=SamplingParams.from_dict(sp.to_dict())))
    sched.step()  # prefill
    sched.step()  # first decode step: launched, not read back yet
    assert sched.inflight is not None and len(sched.inflight.reqs) == len(ps)
    while sched.has_work():
        sched.step()
    assert sched.kv_pool_is_fully_free()
    fresh = new_llm(tiny_model)  # same seed as `sync`: the same draws when the batches have the same shapes
    assert [o.token_ids for o in fresh.generate(ps, sp, use_tqdm=False)] == \
           [o.token_ids for o in sync.generate(ps, sp, use_tqdm=False)]
    assert fresh.scheduler.kv_pool_is_fully_free() and sync.scheduler.kv_pool_is_fully_free()


def test_seeded_requests_decode_synchronously(tiny_model):
    llm = new_llm(tiny_model)
    sched = llm.scheduler
    sched.add_request(Req(rid="seeded", input_ids=[5, 6, 7],
                          sampling_params=SamplingParams(temperature=0.9, seed=11, max_tokens=6, ignore_eos=True)))
    for _ in range(3):
        sched.step()
        assert sched.inflight is None
    while sched.has_work():
        sched.step()
    assert sched.kv_pool_is_fully_free()
