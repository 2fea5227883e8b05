"""Benchmark workloads: prompts of exact token lengths built from the served model's tokenizer.

A prompt is a run of whole-word vocabulary tokens (" the", " of", ...): a byte-level BPE tokenizer splits text at
spaces before merging, so n such words encode to exactly n tokens, and a shared prefix stays a token-level prefix.
Lengths are drawn from the dataset's generator, words from the builder's own: the same shapes can be rebuilt with
fresh words, so a second run at another rate finds nothing of the first in a prefix cache.

Datasets: `random` (uniform lengths), `mix` (issue 14's 70% chat 512-2048 in / 128-384 out + 30% long documents
6k-8k in / 64-128 out, with scale factors), `sessions` (multi-turn chats whose history grows turn by turn) and
`trace` (JSONL replay: timestamp, input_len, output_len, optional prefix_group and prefix_len).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from random import Random
from typing import Any


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload; `session`/`turn` order the turns of a multi-turn chat."""

    prompt: str
    input_len: int
    output_len: int
    arrival_s: float | None = None  # a trace's own schedule; None: the arrival process decides
    session: int | None = None
    turn: int = 0


FIT_POLICIES = ("drop", "clip", "refuse")
WORD = re.compile(r" [A-Za-z]+")  # a space-led word: byte-level BPE never merges across the space
MIN_WORDS = 16


class PromptBuilder:
    """Texts of exact token counts as the server counts them: special tokens included, and with `chat` the chat
    template's tokens around a single user message too."""

    def __init__(self, tokenizer: Any, chat: bool = False, words_seed: int = 0):
        self.tokenizer = tokenizer
        self.chat = chat
        self.rng = Random(words_seed)  # draws the words only, so one workload's shapes can take fresh words
        self.words = self._single_token_words()
        if len(self.words) < MIN_WORDS:
            raise ValueError(f"the tokenizer has only {len(self.words)} single-token words; need {MIN_WORDS}")
        probe = self.words[0] * 4
        self.special_tokens = self.count(probe) - len(tokenizer.encode(probe, add_special_tokens=False))

    @classmethod
    def from_path(cls, path: str, chat: bool = False) -> "PromptBuilder":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), chat)

    def _single_token_words(self) -> list[str]:
        words = []
        for token_id in range(len(self.tokenizer)):
            text = self.tokenizer.decode([token_id])
            if WORD.fullmatch(text) and self.tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                words.append(text)
        return words

    def reseed(self, words_seed: int) -> "PromptBuilder":
        self.rng = Random(words_seed)
        return self

    def words_for(self, count: int) -> str:
        return "".join(self.rng.choice(self.words) for _ in range(count))

    def prompt(self, length: int, prefix: str = "") -> str:
        """`prefix` followed by random words, `length` tokens in all (prefix and special tokens included)."""
        used = self.count(prefix) if prefix else self.special_tokens
        if length < used + 1:
            raise ValueError(f"a prompt of {length} tokens cannot hold its {used}-token prefix and one more token")
        return prefix + self.words_for(length - used)

    def count(self, text: str) -> int:
        if self.chat:
            messages = [{"role": "user", "content": text}]
            templated = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return len(self.tokenizer.encode(templated, add_special_tokens=False))
        return len(self.tokenizer.encode(text))


def uniform(rng: Random, low: int, high: int) -> int:
    return rng.randint(max(1, low), max(1, low, high))


def random_dataset(builder: PromptBuilder, rng: Random, num: int, input_len: int, output_len: int,
                   range_ratio: float) -> list[BenchRequest]:
    """Lengths uniform in [len * range_ratio, len] (SGLang's --random-range-ratio)."""
    requests = []
    for _ in range(num):
        n_in = uniform(rng, int(input_len * range_ratio), input_len)
        n_out = uniform(rng, int(output_len * range_ratio), output_len)
        requests.append(BenchRequest(builder.prompt(n_in), n_in, n_out))
    return requests


@dataclass(frozen=True, slots=True)
class MixShape:
    """Issue 14's chat + long-document mix; the scales shrink it (tests) or grow it."""

    doc_fraction: float = 0.3
    chat_input: tuple[int, int] = (512, 2048)
    chat_output: tuple[int, int] = (128, 384)
    doc_input: tuple[int, int] = (6144, 8192)
    doc_output: tuple[int, int] = (64, 128)
    input_scale: float = 1.0
    output_scale: float = 1.0

    def draw(self, rng: Random) -> tuple[int, int]:
        is_doc = rng.random() < self.doc_fraction
        low_in, high_in = self.doc_input if is_doc else self.chat_input
        low_out, high_out = self.doc_output if is_doc else self.chat_output
        return (uniform(rng, round(low_in * self.input_scale), round(high_in * self.input_scale)),
                uniform(rng, round(low_out * self.output_scale), round(high_out * self.output_scale)))


def mix_dataset(builder: PromptBuilder, rng: Random, num: int, shape: MixShape) -> list[BenchRequest]:
    requests = []
    for _ in range(num):
        n_in, n_out = shape.draw(rng)
        requests.append(BenchRequest(builder.prompt(n_in), n_in, n_out))
    return requests


def sessions_dataset(builder: PromptBuilder, num_sessions: int, turns: int, system_len: int,
                     user_len: int, output_len: int) -> list[BenchRequest]:
    """Turn k's prompt is turn k-1's prompt + an assistant reply of turn k-1's output length + a new user message,
    so every turn shares the whole history before it. Requests come session-interleaved (turn 0 of every session,
    then turn 1, ...); the load generator sends a turn only after the previous one has finished."""
    requests: list[BenchRequest] = []
    for session in range(num_sessions):
        history = builder.prompt(system_len + builder.special_tokens)
        for turn in range(turns):
            if turn:
                history += builder.words_for(output_len)
            length = builder.count(history) + user_len
            history = builder.prompt(length, prefix=history)
            requests.append(BenchRequest(history, length, output_len, session=session, turn=turn))
    return sorted(requests, key=lambda r: (r.turn, r.session))


@dataclass(frozen=True, slots=True)
class TraceEntry:
    timestamp: float
    input_len: int
    output_len: int
    prefix_group: str | None = None
    prefix_len: int | None = None


def parse_trace(path: Path, time_unit: str = "s") -> list[TraceEntry]:
    """JSONL, one request a line: {"timestamp", "input_len", "output_len", optional "prefix_group", "prefix_len"};
    `input_length`/`output_length` (Mooncake's trace names) are accepted too. Bad lines name their line number."""
    scale = {"s": 1.0, "ms": 1e-3}[time_unit]
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entries.append(_trace_entry(json.loads(line), scale))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
    if not entries:
        raise ValueError(f"{path}: no requests")
    return sorted(entries, key=lambda e: e.timestamp)


def _trace_entry(row: dict, scale: float) -> TraceEntry:
    def positive_int(*names: str) -> int:
        value = next((row[n] for n in names if n in row), None)
        if value is None:
            raise KeyError(f"missing {names[0]}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{names[0]} must be a positive integer, got {value!r}")
        return value

    timestamp = row["timestamp"]
    if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool) or timestamp < 0:
        raise ValueError(f"timestamp must be a non-negative number, got {timestamp!r}")
    group = row.get("prefix_group")
    prefix_len = positive_int("prefix_len") if "prefix_len" in row else None
    return TraceEntry(timestamp * scale, positive_int("input_len", "input_length"),
                      positive_int("output_len", "output_length"), None if group is None else str(group), prefix_len)


def trace_dataset(builder: PromptBuilder, entries: list[TraceEntry], default_prefix_len: int,
                  speedup: float = 1.0) -> list[BenchRequest]:
    """Requests of one prefix group share their group's prefix (its length: the entry's prefix_len or
    `default_prefix_len`, never more than the prompt minus one token)."""
    start = entries[0].timestamp
    prefixes: dict[tuple[str, int], str] = {}
    requests = []
    for entry in entries:
        prefix = ""
        if entry.prefix_group is not None:
            length = min(entry.prefix_len or default_prefix_len, entry.input_len - 1)
            if length > builder.special_tokens:
                key = (entry.prefix_group, length)
                prefix = prefixes.setdefault(key, builder.prompt(length))
        requests.append(BenchRequest(builder.prompt(entry.input_len, prefix), entry.input_len, entry.output_len,
                                     arrival_s=(entry.timestamp - start) / speedup))
    return requests


def tokens_needed(request: BenchRequest) -> int:
    return request.input_len + request.output_len


def clipped(request: BenchRequest, context_len: int) -> BenchRequest:
    """`request` with its prompt shortened from the end (a prompt is single-token words, so one word is one
    token) until prompt and output fit `context_len`; an output longer than half the context is halved first."""
    output_len = min(request.output_len, context_len // 2)
    input_len = min(request.input_len, context_len - output_len)
    cut = request.input_len - input_len
    prompt = request.prompt.rsplit(" ", cut)[0] if cut else request.prompt
    return replace(request, prompt=prompt, input_len=input_len, output_len=output_len)


def fit_to_context(requests: list[BenchRequest], context_len: int, policy: str) -> tuple[list[BenchRequest], int]:
    """The requests that fit `context_len` (prompt + output tokens), and how many did not: `drop` leaves those
    out (SGLang bench_serving's --sharegpt-context-len), `clip` shortens them (`clipped`), `refuse` raises
    ValueError naming them."""
    too_long = [r for r in requests if tokens_needed(r) > context_len]
    if too_long and policy == "refuse":
        longest = max(too_long, key=tokens_needed)
        raise ValueError(f"{len(too_long)} of {len(requests)} requests need more than the server's "
                         f"{context_len}-token context (the longest: {longest.input_len} prompt + "
                         f"{longest.output_len} output tokens)")
    if policy == "drop":
        return [r for r in requests if tokens_needed(r) <= context_len], len(too_long)
    return [clipped(r, context_len) if tokens_needed(r) > context_len else r for r in requests], len(too_long)
