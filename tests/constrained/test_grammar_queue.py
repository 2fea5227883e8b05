"""Where a server cannot compile grammars at all, a grammar request is refused at once, naming why."""

from __future__ import annotations

import builtins
import time
from types import SimpleNamespace

import pytest

from pdserve.config import ServerArgs
from pdserve.constrained.compiler import GrammarError
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.grammar_queue import GrammarQueue
from pdserve.scheduler.request import Req

MODEL = SimpleNamespace(vocab_size=1280, eos_token_ids=(1279,))


def queue(tiny_model, **args) -> GrammarQueue:
    from pdserve.tokenizer import load_tokenizer

    server_args = ServerArgs(model_path=tiny_model, device="cpu", **args)
    return GrammarQueue(server_args, MODEL, lambda: load_tokenizer(server_args))


def regex_req() -> Req:
    return Req.of("r", [1, 2], SamplingParams(regex="[0-9]+"))


def test_grammar_backend_none_refuses_grammars(tiny_model):
    q = queue(tiny_model, grammar_backend="none")
    with pytest.raises(GrammarError, match="--grammar-backend none"):
        q.submit(regex_req())
    assert not q.pending
    q.close()


def test_without_xgrammar_the_message_names_the_package(tiny_model, monkeypatch):
    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError("No module named 'xgrammar'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    q = queue(tiny_model)
    with pytest.raises(GrammarError, match=r"needs the xgrammar package \(pip install 'xgrammar==0.2.8'\)"):
        q.submit(regex_req())
    q.close()


def test_a_compiled_grammar_is_handed_on_and_shared(tiny_model):
    q = queue(tiny_model)
    first, second = regex_req(), regex_req()
    q.submit(first)
    q.submit(second)
    q.pending[0].compiled.result(timeout=30)
    outcomes = q.poll()
    assert [o.req for o in outcomes] == [first, second] and all(o.grammar is not None for o in outcomes)
    stats = q.stats()
    assert stats["grammar_compile_seconds"] > 0
    assert stats | {"grammar_compile_seconds": 0} == {"constrained_requests": 2, "grammar_compiles": 1,
                                                       "grammar_cache_hits": 1, "grammar_compile_seconds": 0,
                                                       "grammar_waiting": 0}
    q.close()


def test_the_first_grammar_prepares_the_tokenizer_off_the_callers_thread(tiny_model):
    from pdserve.tokenizer import load_tokenizer

    server_args = ServerArgs(model_path=tiny_model, device="cpu")

    def slow_tokenizer():
        time.sleep(1.0)
        return load_tokenizer(server_args)

    q = GrammarQueue(server_args, MODEL, slow_tokenizer)
    started = time.monotonic()
    q.submit(regex_req())
    assert time.monotonic() - started < 0.5  # the scheduler goes on stepping meanwhile
    assert not q.poll()
    deadline = time.monotonic() + 30
    while not (outcomes := q.poll()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(outcomes) == 1 and outcomes[0].grammar is not None
    q.close()


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 2), (16, 8)])
def test_a_compile_spreads_its_token_masks_over_the_processes_cpus(tiny_model, monkeypatch, cpus, threads):
    """xgrammar computes each new state's token mask over the whole vocabulary (33 states for a 32-character string
    bound): a first schema's compile time divides by its threads, up to xgrammar's default of 8."""
    import xgrammar

    from pdserve.constrained import compiler

    built = []

    class RecordingCompiler(xgrammar.GrammarCompiler):
        def __init__(self, info, max_threads):
            built.append(max_threads)
            super().__init__(info, max_threads=max_threads)

    monkeypatch.setattr(compiler.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(xgrammar, "GrammarCompiler", RecordingCompiler)
    q = queue(tiny_model)
    q.submit(Req.of("s", [1, 2], SamplingParams(json_schema='{"type": "string", "maxLength": 32}')))
    q.pending[0].compiled.result(timeout=60)
    assert built == [threads] and q.poll()[0].grammar is not None
    q.close()
