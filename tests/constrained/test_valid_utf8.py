"""Constrained output is valid UTF-8: xgrammar alone lets a JSON string take the three-byte encoding of a UTF-16
surrogate (ED A0..BF xx), which decodes to three U+FFFD and breaks maxLength; the matcher refuses it, in its
bitmask and when a token is replayed (the decode's path in PD), while real characters stay allowed."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.constrained.compiler import GrammarCompiler, GrammarSpec
from pdserve.constrained.matcher import RequestGrammar

xgrammar = pytest.importorskip("xgrammar")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}


@pytest.fixture(scope="module")
def setup(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], any_whitespace=False)
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


def allowed(grammar: RequestGrammar, token: int) -> bool:
    bitmask = xgrammar.allocate_token_bitmask(1, len(grammar.guard.allowed_words) * 32)
    grammar.fill(bitmask, 0)
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def test_a_surrogate_second_byte_is_refused_after_the_lead_byte(setup):
    byte = setup[3]
    grammar = inside_string(setup)
    assert allowed(grammar, byte[0xED]) and grammar.accept(byte[0xED])
    for second in (0xA0, 0xAF, 0xBF):
        assert not allowed(grammar, byte[second])
        assert not grammar.accept(byte[second])
    assert allowed(grammar, byte[0x9F]) and grammar.accept(byte[0x9F])  # ED 9F xx is U+D000..U+D7FF
    assert grammar.accept(byte[0x80])
    assert allowed(grammar, byte[0xC3]) and grammar.accept(byte[0xC3]) and grammar.accept(byte[0xA9])  # é


def test_no_token_holding_a_surrogate_is_ever_allowed(setup):
    grammar = inside_string(setup)
    bitmask = xgrammar.allocate_token_bitmask(1, len(grammar.guard.allowed_words) * 32)
    grammar.fill(bitmask, 0)
    bits = ((bitmask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1).flatten()
    assert not any(bits[token] for token in grammar.guard.never)


def test_xgrammar_alone_still_lets_the_surrogate_through(setup):
    """The guard stays needed while this holds; drop it once xgrammar refuses surrogates itself."""
    tokenizer, _, compiled, byte = setup
    matcher = xgrammar.GrammarMatcher(compiled)
    for token in tokenizer.encode('{"name": "', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert all(matcher.accept_token(byte[b]) for b in (0xED, 0xA0, 0x80))
