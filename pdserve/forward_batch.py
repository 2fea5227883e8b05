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
    """Two host-to-device copies: every int64 field in one buffer, every int32 field in another."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    starts, acc = [], 0
    for e in extend_lens:
        starts.append(acc)
        acc += e
    width = max((len(r) for r in page_rows), default=1) or 1
    table = flat_page_table(page_rows, width)
    t, b = len(input_ids), len(seq_lens)
    longs = to_device(array("q", [*input_ids, *positions, *out_cache_loc, *logits_indices]), torch.int64, device)
    ints = to_device(array("i", [*seq_lens, *prefix_lens, *extend_lens, *starts, *table]), torch.int32, device)
    return ForwardBatch(
        mode=mode,
        input_ids=longs[:t],
        positions=longs[t : 2 * t],
        out_cache_loc=longs[2 * t : 3 * t],
        logits_indices=longs[3 * t :],
        seq_lens=ints[:b],
        prefix_lens=ints[b : 2 * b],
        extend_lens=ints[2 * b : 3 * b],
        extend_start_loc=ints[3 * b : 4 * b],
        page_table=ints[4 * b :].view(b, width),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
        page_size=page_size,
    )
