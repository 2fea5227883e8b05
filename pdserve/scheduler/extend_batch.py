"""The extend batch: new prompts and prompt chunks, assembled into one ForwardBatch (the decode side's
counterpart is `DecodeInputBatch`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from pdserve.scheduler.request import Req


@dataclass(slots=True)
class ExtendItem:
    req: Req
    start: int  # first position computed in this pass
    end: int  # one past the last position computed in this pass

    @property
    def completes_prefill(self) -> bool:
        return self.end == len(self.req.all_ids)


@dataclass(slots=True, frozen=True)
class ExtendBatch:
    items: list[ExtendItem]
    forward_batch: ForwardBatch
    logit_rows: list[tuple[int, int]]  # per item: (its first row of the logits, how many rows)

    @classmethod
    def of(cls, items: list[ExtendItem], wants_input_logprobs: Callable[[Req], bool], page_size: int,
           device: torch.device) -> ExtendBatch:
        """Logits are computed for the last token of each completed prompt, and for every token of the
        requests that asked for prompt logprobs."""
        input_ids, positions, slots, logit_rows = [], [], [], []
        row_of: list[tuple[int, int]] = []
        for item in items:
            fill = item.req.all_ids
            offset = len(input_ids)
            input_ids += fill[item.start : item.end]
            positions += range(item.start, item.end)
            slots += token_slots(item.req.pages, item.start, item.end, page_size)
            first = len(logit_rows)
            if wants_input_logprobs(item.req):
                logit_rows += range(offset, offset + item.end - item.start)
            elif item.completes_prefill:
                logit_rows.append(len(input_ids) - 1)
            row_of.append((first, len(logit_rows) - first))
        batch = build_forward_batch(
            ForwardMode.EXTEND, input_ids, positions, slots,
            prefix_lens=[i.start for i in items], extend_lens=[i.end - i.start for i in items],
            page_rows=[i.req.pages for i in items], logits_indices=logit_rows, page_size=page_size, device=device,
        )
        return cls(items, batch, row_of)

    def completed(self) -> tuple[list[ExtendItem], list[int]]:
        """The items whose prompt this pass completes, and the logits row of each one's last token."""
        done = [(item, first + count - 1) for item, (first, count) in zip(self.items, self.logit_rows)
                if item.completes_prefill]
        return [item for item, _ in done], [row for _, row in done]


def token_slots(pages: list[int], start: int, end: int, page_size: int) -> list[int]:
    """KV slots of positions [start, end) of a request whose KV lives in `pages`, one page's range at a time."""
    slots: list[int] = []
    for i in range(start // page_size, (end - 1) // page_size + 1) if end > start else ():
        first = i * page_size
        base = pages[i] * page_size - first
        slots += range(base + max(start, first), base + min(end, first + page_size))
    return slots
