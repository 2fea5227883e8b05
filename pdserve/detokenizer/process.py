"""Detokenizer process: turns the scheduler's token ids into text, incrementally and per request.

Text is released only once it is final: a decode that ends in U+FFFD (an incomplete multi-byte
character) waits for the next token, and text that could still become a stop string is held back
until the request either finishes or the text moves past it (OpenAI semantics: the stop string and
everything after it is never returned).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pdserve.messages import (
    BatchStrOut,
    BatchTokenOut,
    DecodeSettings,
    ProcessReady,
    StrOut,
    TokenOut,
)

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DecodeState:
    settings: DecodeSettings
    ids: list[int] = field(default_factory=list)
    surr_offset: int = 0  # start of the context window re-decoded with new tokens
    read_offset: int = 0  # ids before this are already in `text`
    text: str = ""
    sent: int = 0  # chars of `text` already returned


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def register(self, settings: DecodeSettings) -> None:
        self.states[settings.rid] = DecodeState(settings)

    def process(self, batch: BatchTokenOut) -> BatchStrOut:
        outputs = []
        for out in batch.outputs:
            state = self.states.get(out.rid)
            if state is None:
                logger.warning("tokens for unknown request %s dropped", out.rid)
                continue
            outputs.append(self._process_one(state, out))
            if out.finish_reason is not None:
                del self.states[out.rid]
        return BatchStrOut(outputs)

    def _process_one(self, state: DecodeState, out: TokenOut) -> StrOut:
        finished = out.finish_reason is not None
        self._append(state, out.new_token_ids, finished)
        limit = _releasable_len(state, out.finish_reason)
        new_text = state.text[state.sent : limit]
        state.sent = max(state.sent, limit)
        logprobs, top_logprobs = self._logprob_entries(state, out)
        return StrOut(
            rid=out.rid,
            text=new_text,
            new_token_ids=out.new_token_ids,
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            output_logprobs=logprobs,
            output_top_logprobs=top_logprobs,
            input_logprobs=out.input_logprobs,
            input_top_logprobs=None if out.input_top_logprobs is None else self._top_entries(out.input_top_logprobs),
            stage_marks=out.stage_marks,
        )

    def _append(self, state: DecodeState, new_ids: list[int], finished: bool) -> None:
        state.ids.extend(new_ids)
        skip = state.settings.skip_special_tokens
        surr_text = self._decode(state.ids[state.surr_offset : state.read_offset], skip)
        full_text = self._decode(state.ids[state.surr_offset :], skip)
        if finished or (len(full_text) > len(surr_text) and not full_text.endswith(REPLACEMENT_CHAR)):
            state.text += full_text[len(surr_text) :]
            state.surr_offset = state.read_offset
            state.read_offset = len(state.ids)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _logprob_entries(self, state: DecodeState, out: TokenOut) -> tuple[list, list]:
        if not state.settings.return_logprob:
            return [], []
        logprobs = [
            [logprob, token_id, self._token_text(token_id)]
            for logprob, token_id in zip(out.new_logprobs, out.new_token_ids)
        ]
        return logprobs, self._top_entries(out.new_top_logprobs)

    def _top_entries(self, per_position: list) -> list:
        """The scheduler's [[token_id, logprob], ...] of each position (None where there are none) in SGLang's
        order, [[logprob, token_id, text], ...]."""
        return [None if entries is None else [[lp, tid, self._token_text(tid)] for tid, lp in entries]
                for entries in per_position]

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _releasable_len(state: DecodeState, finish_reason: dict | None) -> int:
    """How much of `state.text` may be returned now without ever returning (part of) a stop string."""
    text = state.text
    matched = finish_reason.get("matched") if finish_reason else None
    if isinstance(matched, str) and finish_reason.get("type") == "stop":
        cut = text.find(matched)
        return max(cut, state.sent) if cut >= 0 else len(text)
    if finish_reason is not None:
        return len(text)
    limit = len(text)
    for stop in state.settings.stop:
        found = text.find(stop, max(0, state.sent - len(stop) + 1))
        if found >= 0:
            limit = min(limit, found)
        limit = min(limit, len(text) - _partial_suffix_len(text, stop))
    return max(limit, state.sent)


def _partial_suffix_len(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def run_detokenizer_process(args: Any, packed_tokenizer: bytes) -> None:
    """Entry point of the detokenizer child (spawned by `server/serve.py`, with the tokenizer it loaded, packed: so
    this process never imports torch)."""
    import zmq

    from pdserve.ipc import ipc_addr, pull_socket, push_socket
    from pdserve.messages import MessageError, decode, encode
    from pdserve.process_setup import child_setup
    from pdserve.tokenizer import unpack_tokenizer

    child_setup("detokenizer", args.log_level)
    detokenizer = IncrementalDetokenizer(unpack_tokenizer(packed_tokenizer, args))
    ctx = zmq.Context()
    receiver = pull_socket(ctx, ipc_addr(args, "detokenizer"), bind=True)
    sender = push_socket(ctx, ipc_addr(args, "tokenizer"))
    sender.send(encode(ProcessReady("detokenizer")))
    while True:
        try:
            msg = decode(receiver.recv())
        except MessageError as exc:
            logger.error("dropped a malformed message: %s", exc)
            continue
        if isinstance(msg, DecodeSettings):
            detokenizer.register(msg)
        elif isinstance(msg, BatchTokenOut):
            sender.send(encode(detokenizer.process(msg)))
        else:
            logger.error("unexpected message %s", type(msg).__name__)
