"""Workloads of the serving benchmark: arrival processes, trace files, and prompts of exact token lengths."""

from __future__ import annotations

import json
from random import Random

import numpy as np
import pytest

from pdserve.bench.datasets import (MixShape, PromptBuilder, mix_dataset, parse_trace, random_dataset,
                                    sessions_dataset, trace_dataset)
from pdserve.bench.loadgen import arrival_offsets, schedule


@pytest.fixture(scope="module")
def builder(tiny_model) -> PromptBuilder:
    return PromptBuilder.from_path(tiny_model)


def server_count(builder: PromptBuilder, text: str) -> int:
    return len(builder.tokenizer.encode(text))  # what the server's tokenizer manager computes


def test_poisson_arrivals_are_reproducible_with_a_seed_and_have_the_asked_rate():
    first = arrival_offsets(2000, rate=4.0, arrival="poisson", seed=7)
    assert first == arrival_offsets(2000, rate=4.0, arrival="poisson", seed=7)
    assert first != arrival_offsets(2000, rate=4.0, arrival="poisson", seed=8)
    gaps = np.diff(first)
    assert first[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.08)
    assert gaps.std() == pytest.approx(0.25, rel=0.1)  # exponential: std == mean


def test_constant_and_all_at_once_arrivals():
    assert arrival_offsets(4, rate=2.0, arrival="constant", seed=0) == [0.0, 0.5, 1.0, 1.5]
    assert arrival_offsets(3, rate=float("inf"), arrival="poisson", seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="positive"):
        arrival_offsets(3, rate=0.0, arrival="poisson", seed=0)
    with pytest.raises(ValueError, match="unknown arrival"):
        arrival_offsets(3, rate=1.0, arrival="burst", seed=0)


def write_trace(tmp_path, rows) -> object:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_trace_replay_parses_sorts_and_keeps_its_own_schedule(tmp_path, builder):
    path = write_trace(tmp_path, [
        {"timestamp": 2500, "input_len": 40, "output_len": 4, "prefix_group": "a"},
        {"timestamp": 1000, "input_length": 30, "output_length": 3},  # Mooncake's field names
        "",
        {"timestamp": 1500, "input_len": 50, "output_len": 5, "prefix_group": "a", "prefix_len": 20},
        {"timestamp": 3000, "input_len": 60, "output_len": 6, "prefix_group": "a", "prefix_len": 20},
    ])
    entries = parse_trace(path, time_unit="ms")
    assert [(e.timestamp, e.input_len, e.output_len) for e in entries] == [(1.0, 30, 3), (1.5, 50, 5), (2.5, 40, 4),
                                                                         (3.0, 60, 6)]
    requests = trace_dataset(builder.reseed(0), entries, default_prefix_len=16, speedup=2.0)
    assert [r.arrival_s for r in requests] == [0.0, 0.25, 0.75, 1.0]
    assert schedule(requests, rate=100.0, arrival="poisson", seed=0) == [0.0, 0.25, 0.75, 1.0]
    assert [server_count(builder, r.prompt) for r in requests] == [30, 50, 40, 60]
    shared = builder.tokenizer.encode(requests[1].prompt)[:20]
    assert builder.tokenizer.encode(requests[3].prompt)[:20] == shared  # same group and prefix length
    assert builder.tokenizer.encode(requests[2].prompt)[:16] != shared[:16]  # another prefix length


@pytest.mark.parametrize("line, message", [
    ('{"input_len": 3, "output_len": 1}', "timestamp"),
    ('{"timestamp": 0, "input_len": 0, "output_len": 1}', "input_len must be a positive integer"),
    ('{"timestamp": -1, "input_len": 3, "output_len": 1}', "non-negative"),
    ('{"timestamp": 0, "input_len": 3}', "missing output_len"),
    ("{not json", "trace.jsonl:2"),
])
def test_bad_trace_lines_are_refused_with_their_line_number(tmp_path, line, message):
    path = write_trace(tmp_path, [{"timestamp": 0, "input_len": 3, "output_len": 1}, line])
    with pytest.raises(ValueError, match=message) as info:
        parse_trace(path)
    assert "trace.jsonl:2" in str(info.value)


def test_random_prompts_have_exact_token_lengths(builder):
    requests = random_dataset(builder, Random(1), 30, input_len=200, output_len=20, range_ratio=0.1)
    assert [server_count(builder, r.prompt) for r in requests] == [r.input_len for r in requests]
    assert all(20 <= r.input_len <= 200 and 2 <= r.output_len <= 20 for r in requests)
    assert len({r.input_len for r in requests}) > 10


def test_the_same_shapes_take_fresh_words_with_another_words_seed(builder):
    first = random_dataset(builder.reseed(1), Random(5), 8, input_len=64, output_len=8, range_ratio=0.5)
    again = random_dataset(builder.reseed(1), Random(5), 8, input_len=64, output_len=8, range_ratio=0.5)
    fresh = random_dataset(builder.reseed(2), Random(5), 8, input_len=64, output_len=8, range_ratio=0.5)
    assert again == first
    assert [(r.input_len, r.output_len) for r in fresh] == [(r.input_len, r.output_len) for r in first]
    assert all(a.prompt[:40] != b.prompt[:40] for a, b in zip(first, fresh))


def test_the_chat_and_document_mix_scales_and_keeps_its_proportions(builder):
    shape = MixShape(input_scale=1 / 32, output_scale=1 / 16)
    requests = mix_dataset(builder, Random(2), 300, shape)
    docs = [r for r in requests if r.input_len >= 6144 / 32]
    chats = [r for r in requests if r.input_len < 6144 / 32]
    assert 0.22 < len(docs) / len(requests) < 0.38
    assert all(192 <= r.input_len <= 256 and 4 <= r.output_len <= 8 for r in docs)
    assert all(16 <= r.input_len <= 64 and 8 <= r.output_len <= 24 for r in chats)
    assert [server_count(builder, r.prompt) for r in requests[:40]] == [r.input_len for r in requests[:40]]


def test_sessions_grow_a_shared_history_turn_by_turn(builder):
    requests = sessions_dataset(builder.reseed(3), num_sessions=2, turns=3, system_len=20, user_len=10,
                                output_len=8)
    assert [(r.session, r.turn) for r in requests] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    for session in (0, 1):
        turns = [r for r in requests if r.session == session]
        assert [r.input_len for r in turns] == [30, 48, 66]
        for earlier, later in zip(turns, turns[1:]):
            assert later.prompt.startswith(earlier.prompt)
            ids = builder.tokenizer.encode(later.prompt)
            assert ids[:earlier.input_len] == builder.tokenizer.encode(earlier.prompt)
        assert [server_count(builder, r.prompt) for r in turns] == [30, 48, 66]


def test_chat_prompts_count_the_chat_template(tiny_model):
    chat = PromptBuilder.from_path(tiny_model, chat=True)
    prompt = chat.prompt(50)
    templated = chat.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
    assert len(chat.tokenizer.encode(templated, add_special_tokens=False)) == 50
    with pytest.raises(ValueError, match="cannot hold"):
        chat.prompt(chat.special_tokens)
