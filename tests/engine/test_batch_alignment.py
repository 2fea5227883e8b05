"""Every device field of a forward batch starts a multiple of 16 bytes into its upload buffer: Triton
compiles a kernel variant per 16-byte alignment of each pointer argument, so fields that moved with the batch's
sizes compiled new variants under traffic (odd token counts, batch sizes not a multiple of 4)."""

from __future__ import annotations

import pytest
import torch

from pdserve.forward_batch import ALIGN_BYTES, ForwardMode, build_forward_batch, packed_to_device
from pdserve.scheduler.decode_input_batch import DecodeInputBatch
from pdserve.scheduler.request import Req
from pdserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
FIELDS = ("input_ids", "positions", "out_cache_loc", "logits_indices", "seq_lens", "prefix_lens", "extend_lens",
          "extend_start_loc", "page_table")


def offset_bytes(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


def test_packed_views_hold_the_segments_each_on_a_16_byte_boundary():
    segments = [[1, 2, 3], [], [4], [5, 6, 7, 8, 9]]
    for dtype in (torch.int64, torch.int32):
        views = packed_to_device(segments, dtype, CPU)
        assert [v.tolist() for v in views] == segments
        assert all(offset_bytes(v) % ALIGN_BYTES == 0 for v in views)


@pytest.mark.parametrize("extend_lens", [[1], [17], [3, 5], [1, 17, 250], [16, 17, 31, 5], [7] * 5])
def test_extend_batch_fields_are_aligned_whatever_the_lengths(extend_lens):
    page_size, t = 16, sum(extend_lens)
    prefix_lens = [16 * i for i in range(len(extend_lens))]
    rows = [list(range(1, (p + e) // page_size + 2)) for p, e in zip(prefix_lens, extend_lens)]
    batch = build_forward_batch(ForwardMode.EXTEND, list(range(t)), list(range(t)), list(range(t)), prefix_lens,
                                extend_lens, rows, [t - 1], page_size, CPU)
    assert all(offset_bytes(getattr(batch, name)) % ALIGN_BYTES == 0 for name in FIELDS)
    assert batch.extend_lens.tolist() == extend_lens and batch.prefix_lens.tolist() == prefix_lens
    assert batch.page_table.shape == (len(extend_lens), max(map(len, rows)))


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_decode_batch_fields_are_aligned_whatever_the_batch_size(size):
    reqs = []
    for i in range(size):
        req = Req(rid=str(i), input_ids=[1, 2, 3], sampling_params=SamplingParams())
        req.pages = [i + 1]
        reqs.append(req)
    batch = DecodeInputBatch(reqs, page_size=4, max_pages=8, device=CPU)
    for r in reqs:
        r.pages.append(r.pages[0] + 100)  # a new page each: the patch travels in the same upload
    fb = batch.forward_batch(list(range(size)), [5] * size)
    assert all(offset_bytes(getattr(fb, name)) % ALIGN_BYTES == 0
               for name in ("input_ids", "positions", "out_cache_loc", "seq_lens", "prefix_lens"))
    assert [row[1] for row in fb.page_table.tolist()] == [r.pages[1] for r in reqs]
