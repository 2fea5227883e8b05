"""Grammar compilation off the scheduler's thread, cached by (kind, text) for one tokenizer.

`GrammarCompiler.submit` returns a future at once; the scheduler polls it between steps, so a request waits for
its compile without holding up the others. Requests with the same grammar share one compile (and its result).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from threading import Lock
from typing import Any

from pdserve.constrained.json_schema import strict_json_grammar, strict_json_schema
from pdserve.constrained.utf8_guard import Utf8Guard

_NATIVE_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " prefix
MISSING_PACKAGE = "structured output needs the xgrammar package (pip install 'xgrammar==0.2.8')"
MAX_COMPILE_THREADS = 8  # xgrammar's own default


def compile_threads() -> int:
    """Threads one compile spreads its token masks over: this process's CPUs, at most MAX_COMPILE_THREADS."""
    return min(MAX_COMPILE_THREADS, len(os.sched_getaffinity(0)))


class GrammarError(ValueError):
    """A grammar the server cannot use (invalid, unsupported, or no backend); HTTP 400."""


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """An output constraint as the request gave it: kind is json_schema, regex, ebnf or structural_tag."""

    kind: str
    text: str


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise GrammarError(MISSING_PACKAGE) from exc
    return xgrammar


@dataclass(slots=True, frozen=True)
class _Vocabulary:
    """What every compile of one tokenizer shares, built once in the compile pool."""

    compiler: Any  # xgrammar.GrammarCompiler
    token_bytes: list[bytes]  # each token's bytes, as xgrammar decodes them
    utf8_guard: Utf8Guard


class GrammarCompiler:
    """Compiles grammars for one tokenizer in a thread pool; each distinct spec is compiled once. The tokenizer's
    preparation (loading it, xgrammar's tables: seconds for a 128k vocabulary) is the pool's first task, so not
    even the first grammar holds up the caller's thread.

    A compile's time goes to xgrammar's token mask of each state its rules have not met before (states repeat
    across grammars, so later grammars reuse them): a string of at most 128 characters takes 129 states, each
    checking every token of the vocabulary (4 s for a 128k vocabulary on 2 cores), and then every shorter bound
    reuses them (`json_schema.strict_json_grammar`). xgrammar spreads a compile's states over `compile_threads()`
    threads."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_ids: list[int],
                 any_whitespace: bool, max_workers: int = 1):
        """`stop_ids`: the model's EOS ids, which a grammar allows only where it may end."""
        self.xgr = import_xgrammar()
        self.any_whitespace = any_whitespace
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self.vocabulary = self.pool.submit(self._prepare, load_tokenizer, vocab_size, stop_ids)
        self.cache: dict[GrammarSpec, Future] = {}
        self.lock = Lock()
        self.num_compiles = self.num_cache_hits = 0
        self.compile_seconds = 0.0  # summed over compiles, failed ones included

    def _prepare(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_ids: list[int]) -> _Vocabulary:
        info = self.xgr.TokenizerInfo.from_huggingface(load_tokenizer(), vocab_size=vocab_size,
                                                       stop_token_ids=stop_ids)
        token_bytes = info.decoded_vocab
        return _Vocabulary(self.xgr.GrammarCompiler(info, max_threads=compile_threads()), token_bytes,
                           Utf8Guard(token_bytes))

    @property
    def compiler(self) -> Any:
        return self.vocabulary.result().compiler

    @property
    def token_bytes(self) -> list[bytes]:
        return self.vocabulary.result().token_bytes

    @property
    def utf8_guard(self) -> Utf8Guard:
        return self.vocabulary.result().utf8_guard

    def submit(self, spec: GrammarSpec) -> Future:
        """The future compiled grammar of `spec`; it raises GrammarError when the grammar is bad."""
        with self.lock:
            future = self.cache.get(spec)
            if future is not None:
                self.num_cache_hits += 1
                return future
            future = self.cache[spec] = self.pool.submit(self.compile, spec)
            self.num_compiles += 1
        future.add_done_callback(self._forget_failure(spec))
        return future

    def _forget_failure(self, spec: GrammarSpec):
        def forget(future: Future) -> None:
            if future.exception() is not None:
                with self.lock:
                    self.cache.pop(spec, None)
        return forget

    def compile(self, spec: GrammarSpec) -> Any:
        started = time.perf_counter()
        try:
            return getattr(self, f"_compile_{spec.kind}")(spec.text)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
            raise GrammarError(f"invalid {spec.kind}: {_reason(exc)}") from exc
        finally:
            with self.lock:
                self.compile_seconds += time.perf_counter() - started

    def _compile_json_schema(self, text: str) -> Any:
        grammar = strict_json_grammar(self.xgr, text, self.any_whitespace)
        if grammar is not None:
            return self.compiler.compile_grammar(grammar)
        return self.compiler.compile_json_schema(strict_json_schema(text), any_whitespace=self.any_whitespace)

    def _compile_regex(self, text: str) -> Any:
        return self.compiler.compile_regex(text)

    def _compile_ebnf(self, text: str) -> Any:
        return self.compiler.compile_grammar(text)

    def _compile_structural_tag(self, text: str) -> Any:
        """SGLang's form ({"structures": [{begin, schema, end}], "triggers": [...]}) or xgrammar's own."""
        tag = json.loads(text)
        if not isinstance(tag, dict) or "structures" not in tag:
            return self.compiler.compile_structural_tag(text)
        items = [self.xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return self.compiler.compile_structural_tag(items, tag["triggers"])

    def reset(self) -> None:
        """No grammar cached and the counters at zero, as before any compile (the tokenizer's tables stay)."""
        with self.lock:
            self.cache.clear()
            self.num_compiles = self.num_cache_hits = 0
            self.compile_seconds = 0.0

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _reason(exc: Exception) -> str:
    """The first line of xgrammar's message, without its source location."""
    lines = str(exc).strip().splitlines()
    return _NATIVE_LOCATION.sub("", lines[0]) if lines else type(exc).__name__
