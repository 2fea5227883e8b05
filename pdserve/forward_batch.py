"""The description of one forward pass (`ForwardBatch`) and the builders that upload it from host lists.

A leaf: the attention backends, the model, CUDA graphs and the scheduler's batch builders all read it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from enum import IntEnum

import torch


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill or chunked prefill, possibly on top of a cached prefix
    DECODE = 2  # one new token per request


@dataclass(slots=True)
class ForwardBatch:
    """One forward pass over B requests and T new tokens (T == B for decode).

    Device tensors:
      input_ids [T] int64, positions [T] int64, out_cache_loc [T] int64 (KV slot of each new token),
      seq_lens [B] int32 (KV length after this pass, new tokens included),
      prefix_lens [B] int32 (KV already cached before this pass), extend_lens [B] int32 (new tokens),
      extend_start_loc [B] int32 (offset of each request's first new token in T),
      page_table [B, max_pages] int32 (page ids; row b covers seq_lens[b] tokens),
      logits_indices [N] int64 (rows of the hidden states whose logits are needed).
    Host copies (`*_cpu`) are lists of ints for backends that loop in Python.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    page_table: torch.Tensor
    logits_indices: torch.Tensor
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    page_size: int

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def to_device(values: list | array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the GPU: staged through pinned memory on CUDA
    (a copy from pageable memory would block until the stream's earlier work is done). An `array` of the same
    element type is read through its buffer, skipping the conversion of each Python int."""
    if isinstance(values, array) and values:
        host = torch.frombuffer(values, dtype=dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


ALIGN_BYTES = 16  # Triton compiles a kernel variant per 16-byte alignment of each pointer argument
TYPECODES = {torch.int64: "q", torch.int32: "i"}


def packed_to_device(segments: list[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The segments in one host-to-device copy, as one view each. Every view starts on a 16-byte boundary, so a
    kernel sees the same alignment whatever the batch's sizes, and one compiled variant serves every batch."""
    host = array(TYPECODES[dtype])
    step = ALIGN_BYTES // host.itemsize
    bounds = []
    for segment in segments:
        host.extend([0] * (-len(host) % step))
        bounds.append((len(host), len(host) + len(segment)))
        host.extend(segment)
    packed = to_device(host, dtype, device)
    return [packed[start:end] for start, end in bounds]


def flat_page_table(page_rows: list[list[int]], width: int) -> list[int]:
    """Rows of page ids, each padded with page 0 to `width`, flattened row after row."""
    return [page for row in page_rows for page in (row + [0] * (width - len(row)))]


def build_forward_batch(
    mode: ForwardMode,
    input_ids: list[int],
    positions: list[int],
    out_cache_loc: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    page_rows: list[list[int]],
    logits_indices: list[int],
    page_size: int,
    device: torch.device,
) -> ForwardBatch:
    """Two host-to-device copies: every int64 field in one buffer, every int32 field in another (`packed_to_device`)."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    starts, acc = [], 0
    for e in extend_lens:
        starts.append(acc)
        acc += e
    width = max((len(r) for r in page_rows), default=1) or 1
    table = flat_page_table(page_rows, width)
    ids, pos, locs, logit_rows = packed_to_device([input_ids, positions, out_cache_loc, logits_indices], torch.int64,
                                                  device)
    lens, prefixes, extends, start_locs, pages = packed_to_device([seq_lens, prefix_lens, extend_lens, starts, table],
                                                                  torch.int32, device)
    return ForwardBatch(
        mode=mode,
        input_ids=ids,
        positions=pos,
        out_cache_loc=locs,
        logits_indices=logit_rows,
        seq_lens=lens,
        prefix_lens=prefixes,
        extend_lens=extends,
        extend_start_loc=start_locs,
        page_table=pages.view(len(seq_lens), width),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
        page_size=page_size,
    )
