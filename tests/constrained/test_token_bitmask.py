"""The batch's token bitmask: one buffer kept across steps (grown for a larger batch), filled row by row by the
matchers with the UTF-8 guard applied to the whole batch at once, and applied to every row in one call; a row
without a grammar is left as it is, a constrained row allows exactly what its matcher and the guard allow."""

from __future__ import annotations

import pytest
import torch

from pdserve.constrained.compiler import GrammarCompiler, GrammarSpec
from pdserve.constrained.matcher import RequestGrammar, TokenBitmask, fill_bitmask
from pdserve.constrained.utf8_guard import BOUNDARY, UNRESTRICTED

xgrammar = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def compiler(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id], any_whitespace=False)
    compiler.vocabulary.result(timeout=60)
    yield compiler
    compiler.close()


def grammar(compiler, kind: str, text: str) -> RequestGrammar:
    return RequestGrammar(compiler.submit(GrammarSpec(kind, text)).result(timeout=60), compiler.utf8_guard)


def allowed(compiler, g: RequestGrammar, guarded: bool = True) -> set[int]:
    """What g's matcher (and the UTF-8 guard) allow, one row the way xgrammar documents it."""
    vocab = len(compiler.token_bytes)
    row = xgrammar.allocate_token_bitmask(1, vocab)
    g.matcher.fill_next_token_bitmask(row, 0)
    if guarded:
        row[0, : compiler.utf8_guard.allowed_words.shape[1]] &= compiler.utf8_guard.allowed_words[g.utf8_state]
    bits = ((row[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:vocab]
    return set(bits.nonzero().flatten().tolist())


def test_every_row_is_masked_as_its_own_grammar_says_and_free_rows_are_left_alone(compiler):
    vocab = len(compiler.token_bytes)
    digits, json_string = grammar(compiler, "regex", "[0-9]+"), grammar(compiler, "json_schema", '{"type": "string"}')
    for raw in (b'"', b"\xed"):  # inside a string, after ED: the guard refuses what would make a surrogate
        assert json_string.accept(compiler.token_bytes.index(raw))
    assert json_string.utf8_state != BOUNDARY
    assert allowed(compiler, json_string) < allowed(compiler, json_string, guarded=False)
    grammars = [digits, None, json_string, None]
    logits = torch.randn(len(grammars), vocab, dtype=torch.bfloat16)
    masked = TokenBitmask(max_rows=8).mask(logits, grammars)
    assert masked.dtype == torch.float32 and torch.equal(logits[1].float(), masked[1])
    assert torch.equal(logits[3].float(), masked[3])
    for row in (0, 2):
        finite = set(masked[row].isfinite().nonzero().flatten().tolist())
        assert finite == allowed(compiler, grammars[row]) and 0 < len(finite) < vocab
        assert torch.equal(masked[row, sorted(finite)], logits[row, sorted(finite)].float())


def test_the_buffer_is_kept_across_steps_and_grown_for_a_larger_batch(compiler):
    vocab = len(compiler.token_bytes)
    bitmask = TokenBitmask(max_rows=2)
    g = grammar(compiler, "regex", "[a-z]+")
    bitmask.mask(torch.zeros(2, vocab), [g, None])
    buffer = bitmask.host.data_ptr()
    bitmask.mask(torch.zeros(1, vocab), [g])
    assert bitmask.host.data_ptr() == buffer  # no allocation per step
    masked = bitmask.mask(torch.zeros(3, vocab), [None, None, g])
    assert bitmask.host.shape[0] == 3 and masked[:2].isfinite().all()  # a row left from before is overwritten
    assert set(masked[2].isfinite().nonzero().flatten().tolist()) == allowed(compiler, g)


def test_the_guard_restricts_the_whole_batch_in_one_operation(compiler):
    guard = compiler.utf8_guard
    words = guard.allowed_words.shape[1]
    bitmask = torch.full((3, words), -1, dtype=torch.int32)
    guard.restrict(bitmask, [BOUNDARY, UNRESTRICTED, 1])
    assert torch.equal(bitmask[0], guard.allowed_words[BOUNDARY]) and (bitmask[1] == -1).all()
    assert torch.equal(bitmask[2], guard.allowed_words[1])


def test_fill_bitmask_sets_every_bit_of_a_row_without_a_grammar(compiler):
    g = grammar(compiler, "regex", "[0-9]+")
    bitmask = torch.zeros(2, compiler.utf8_guard.allowed_words.shape[1], dtype=torch.int32)
    fill_bitmask(bitmask, [None, g])
    assert (bitmask[0] == -1).all() and not (bitmask[1] == -1).all()
