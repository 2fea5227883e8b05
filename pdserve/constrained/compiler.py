"""Grammar compilation off the scheduler's thread, cached by (kind, text) for one tokenizer.

`GrammarCompiler.submit` returns a future at once; the scheduler polls it between steps, so a request waits for
its compile without holding up the others. Requests with the same grammar share one compile (and its result).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from threading import Lock
from typing import Any

from pdserve.constrained.json_schema import strict_json_schema
from pdserve.constrained.utf8_guard import Utf8Guard

_NATIVE_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " prefix
MISSING_PACKAGE = "structured output needs the xgrammar package (pip install 'xgrammar==0.2.8')"


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


class GrammarCompiler:
    """Compiles grammars for one tokenizer in a thread pool; each distinct spec is compiled once."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], any_whitespace: bool,
                 max_workers: int = 1):
        """`stop_ids`: the model's EOS ids, which a grammar allows only where it may end."""
        self.xgr = import_xgrammar()
        info = self.xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=max_workers)
        self.token_bytes: list[bytes] = info.decoded_vocab
        self.utf8_guard = Utf8Guard(self.token_bytes)
        self.any_whitespace = any_whitespace
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self.cache: dict[GrammarSpec, Future] = {}
        self.lock = Lock()
        self.num_compiles = self.num_cache_hits = 0
        self.compile_seconds = 0.0  # summed over compiles, failed ones included

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

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _reason(exc: Exception) -> str:
    """The first line of xgrammar's message, without its source location."""
    lines = str(exc).strip().splitlines()
    return _NATIVE_LOCATION.sub("", lines[0]) if lines else type(exc).__name__
