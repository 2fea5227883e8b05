"""Constrained output is valid UTF-8: inside a JSON string xgrammar 0.2.8 alone accepts byte sequences that are not
UTF-8 (surrogates ED A0..BF, overlong E0 80..9F and F0 80..8F), which decode to several U+FFFD and break maxLength;
the matcher refuses them, in its bitmask and when a token is replayed (the decode's path in PD), while every real
character stays allowed. Random walks through the grammar then always give strict UTF-8 that validates."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from pdserve.constrained.compiler import GrammarCompiler, GrammarSpec
from pdserve.constrained.matcher import RequestGrammar, fill_bitmask

xgrammar = pytest.importorskip("xgrammar")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
INVALID_SEQUENCES = {"surrogate": [0xED, 0xA0, 0x80], "overlong 3-byte": [0xE0, 0x85, 0xBA],
                     "overlong 4-byte": [0xF0, 0x8E, 0x89, 0x8F], "past U+10FFFF": [0xF4, 0x90, 0x80, 0x80]}
VALID_CHARACTERS = ["é", "\ud7ff", "\ue000", "中", "\U00010000", "\U0010ffff"]


@pytest.fixture(scope="module")
def setup(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id], any_whitespace=False)
    compiled = compiler.submit(GrammarSpec("json_schema", json.dumps(SCHEMA))).result(timeout=60)
    single_byte = {}
    for token, raw in enumerate(compiler.token_bytes):
        if len(raw) == 1:
            single_byte.setdefault(raw[0], token)
    yield tokenizer, compiler, compiled, single_byte
    compiler.close()


def inside_string(setup) -> RequestGrammar:
    tokenizer, compiler, compiled, _ = setup
    grammar = RequestGrammar(compiled, compiler.utf8_guard)
    for token in tokenizer.encode('{"name": "', add_special_tokens=False):
        assert grammar.accept(token)
    return grammar


def allowed_tokens(grammar: RequestGrammar, vocab_size: int) -> list[int]:
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    fill_bitmask(bitmask, [grammar])
    bits = ((bitmask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:vocab_size]
    return bits.nonzero().flatten().tolist()


@pytest.mark.parametrize("name", INVALID_SEQUENCES)
def test_an_invalid_byte_sequence_is_refused_at_its_first_wrong_byte(setup, name):
    byte, vocab_size = setup[3], len(setup[1].token_bytes)
    sequence = INVALID_SEQUENCES[name]
    grammar = inside_string(setup)
    assert grammar.accept(byte[sequence[0]])
    assert byte[sequence[1]] not in allowed_tokens(grammar, vocab_size)
    assert not grammar.accept(byte[sequence[1]])


@pytest.mark.parametrize("character", VALID_CHARACTERS)
def test_every_real_character_stays_allowed_byte_by_byte(setup, character):
    byte, vocab_size = setup[3], len(setup[1].token_bytes)
    grammar = inside_string(setup)
    for value in character.encode("utf-8"):
        assert byte[value] in allowed_tokens(grammar, vocab_size)
        assert grammar.accept(byte[value])


def test_xgrammar_alone_still_lets_invalid_bytes_through(setup):
    """The guard stays needed while this holds; drop it once xgrammar refuses such bytes itself."""
    tokenizer, _, compiled, byte = setup
    matcher = xgrammar.GrammarMatcher(compiled)
    for token in tokenizer.encode('{"name": "', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert all(matcher.accept_token(byte[b]) for b in INVALID_SEQUENCES["surrogate"])


def test_random_walks_through_the_grammar_give_strict_utf8_that_validates(setup):
    tokenizer, compiler, compiled, _ = setup
    vocab_size, rng = len(compiler.token_bytes), random.Random(0)
    for _ in range(150):
        grammar, output = RequestGrammar(compiled, compiler.utf8_guard), b""
        while not grammar.terminated:
            token = rng.choice(allowed_tokens(grammar, vocab_size))
            assert grammar.accept(token)
            output += b"" if token == tokenizer.eos_token_id else compiler.token_bytes[token]
        jsonschema.validate(json.loads(output.decode("utf-8")), SCHEMA)
