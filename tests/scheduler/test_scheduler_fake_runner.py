"""The scheduler's logic on a fake runner, no model: admission, chunked prefill, decode, retraction, abort, and
where a role acts. The fake model's next token is always the input token + 1, so every output is known."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.engine.sampler import Sampler
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.request import FinishReason, Req
from pdserve.scheduler.role import Role
from pdserve.scheduler.scheduler import Scheduler

VOCAB = 64
PAGE = 4


class FakeRunner:
    """Logits that make `input token + 1` the greedy choice; records each forward's kind and size."""

    def __init__(self, num_pages: int):
        self.model_config = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=(), architecture="Fake")
        self.device = torch.device("cpu")
        self.context_len = 256
        self.pool = SimpleNamespace(layout=SimpleNamespace(num_pages=num_pages))
        self.sampler = Sampler(self.device, seed=0)
        self.forwards: list[tuple[str, int]] = []

    def forward(self, batch: ForwardBatch, on_layer_done=None) -> torch.Tensor:
        extend = batch.mode == ForwardMode.EXTEND
        self.forwards.append(("extend" if extend else "decode", sum(batch.extend_lens_cpu) if extend else
                              batch.batch_size))
        if on_layer_done is not None:
            on_layer_done(0)
        nxt = (batch.input_ids[batch.logits_indices] + 1) % VOCAB
        return torch.nn.functional.one_hot(nxt, VOCAB).float() * 10

    def decode_tokens(self, batch: ForwardBatch, sampling) -> None:
        return None  # the scheduler falls back to forward + sampler


def make(num_pages: int = 64, role: Role | None = None, overlap: bool = False, **kw) -> tuple[Scheduler, FakeRunner]:
    args = ServerArgs(model_path="fake", device="cpu", page_size=PAGE, chunked_prefill_size=8, max_prefill_tokens=8,
                      disable_overlap_schedule=not overlap, **kw)
    runner = FakeRunner(num_pages)
    return Scheduler(args, runner, role), runner


def req(rid: str, prompt: list[int], n: int) -> Req:
    return Req.of(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))


def drain(sched: Scheduler, max_steps: int = 200) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return out
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    raise AssertionError("the scheduler did not drain")


def expected(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + i) % VOCAB for i in range(1, n + 1)]


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_then_batched_decode(overlap):
    sched, runner = make(overlap=overlap, disable_radix_cache=True)
    long, short = list(range(1, 21)), [30, 31, 32]
    sched.add_request(req("long", long, 4))
    sched.add_request(req("short", short, 4))
    assert drain(sched) == {"long": expected(long, 4), "short": expected(short, 4)}
    extends = [n for kind, n in runner.forwards if kind == "extend"]
    assert extends == [8, 8, 4 + 3]  # chunks of 8; the short prompt joins the last chunk's batch
    assert max(n for kind, n in runner.forwards if kind == "decode") == 2
    assert sched.kv_pool_is_fully_free()


def test_admission_waits_for_kv_and_retraction_recomputes():
    # 8 pages of 4 tokens (page 0 reserved): two requests that each grow to 4 pages cannot both finish at once
    sched, runner = make(num_pages=8, schedule_conservativeness=0.0, disable_radix_cache=True)
    prompts = {"a": [1, 2, 3, 4, 5, 6], "b": [9, 10, 11, 12, 13, 14]}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, 10))
    assert drain(sched) == {rid: expected(p, 10) for rid, p in prompts.items()}
    assert sched.num_retracted >= 1
    assert sched.kv_pool_is_fully_free()


def test_a_prompt_larger_than_the_pool_is_refused():
    sched, _ = make(num_pages=4)
    with pytest.raises(ValueError, match="KV cache holds only"):
        sched.add_request(req("big", list(range(1, 30)), 1))


def test_abort_frees_a_running_request():
    sched, _ = make(disable_radix_cache=True)
    sched.add_request(req("r", [1, 2, 3], 50))
    sched.step()
    sched.abort_request("r")
    outs = sched.step()
    assert [o.finish_reason["type"] for o in outs if o.finish_reason] == ["abort"]
    assert not sched.has_work() and sched.kv_pool_is_fully_free()


def test_prefix_cache_reuses_a_finished_prompt():
    sched, runner = make()
    prompt = list(range(1, 18))
    sched.add_request(req("first", prompt, 2))
    drain(sched)
    runner.forwards.clear()
    sched.add_request(req("second", prompt, 2))
    assert drain(sched)["second"] == expected(prompt, 2)
    assert runner.forwards[0] == ("extend", 1)  # 16 of 17 prompt tokens come from the cache



def test_admission_is_one_rule_for_a_prompt_prefilled_here_and_a_handoff_destination():
    sched, _ = make(num_pages=16)
    prompt = list(range(1, 13))  # 3 pages; the cache then holds the first 2 for a new request with this prompt
    sched.add_request(req("first", prompt, 2))
    drain(sched)
    free, hits = sched.allocator.num_free, sched.radix.hit_tokens
    refused = req("refused", prompt, 2)
    assert not sched.admit(refused, reserved=sched.available_pages())
    assert refused.pages == [] and sched.allocator.num_free == free and sched.radix.hit_tokens == hits
    here, handoff = req("here", prompt, 2), req("handoff", prompt, 2)
    for r in (here, handoff):
        r.return_logprob, r.logprob_start_len = True, 0  # prompt logprobs limit the prefix only where computed
    assert sched.admit(here, reserved=0)
    assert here.pages == [] and here.num_cached_tokens == 0  # its chunks take its pages
    assert sched.admit(handoff, reserved=0, handoff_reserve=1)
    assert len(handoff.pages) == 3 and handoff.num_cached_tokens == 2 * PAGE  # the cached prefix, then fresh pages
    assert sched.radix.hit_tokens == hits + 2 * PAGE
    assert not sched.admit(req("no room", prompt, 2), reserved=0, handoff_reserve=sched.available_pages())
    for r in (here, handoff):
        sched.release_pages(r)
    assert sched.kv_pool_is_fully_free()


class HandoffRole(Role):
    """A prefill-like role: records where it is called, ships nothing, ends each request after its first token."""

    def __init__(self):
        self.events: list[tuple] = []

    def accept(self, req: Req) -> None:
        self.events.append(("accept", req.rid))
        self.scheduler.enqueue(req)

    def layer_hook(self, items):
        return lambda layer: self.events.append(("layer", layer))

    def on_chunk_done(self, req: Req, start: int, end: int) -> None:
        self.events.append(("chunk", start, end))

    def keeps_pages(self, req: Req) -> bool:
        return req.rid == "kept"

    def on_prefill_done(self, req: Req) -> None:
        self.events.append(("prefilled", req.output_ids[0]))
        self.scheduler.finish(req, FinishReason("length", message="handed off"))

    def check_stop(self, req: Req) -> FinishReason | None:
        return None

    def stats(self) -> dict:
        return {"handoffs": sum(e[0] == "prefilled" for e in self.events)}


def test_a_role_acts_at_each_of_its_points():
    role = HandoffRole()
    sched, runner = make(role=role, disable_radix_cache=True)
    prompt = list(range(1, 13))
    sched.add_request(req("r", prompt, 5))
    assert drain(sched) == {"r": [13]}
    assert role.events == [("accept", "r"), ("layer", 0), ("chunk", 0, 8), ("layer", 0), ("chunk", 8, 12),
                           ("prefilled", 13)]
    assert [kind for kind, _ in runner.forwards] == ["extend", "extend"]
    assert sched.stats()["handoffs"] == 1 and sched.kv_pool_is_fully_free()


def test_pages_a_role_keeps_are_not_freed_at_finish():
    sched, _ = make(role=HandoffRole(), disable_radix_cache=True)
    sched.add_request(req("kept", [1, 2, 3, 4, 5], 1))
    drain(sched)
    kept = sched.allocator.capacity - sched.allocator.num_free
    assert kept == 2  # the role still reads them; it releases them when done
