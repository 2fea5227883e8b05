"""Requests waiting for their grammar's compile (`pdserve/constrained/`), each with its compile deadline.

A request with a grammar enters its role only once the grammar is compiled: the compile runs in a thread, a pipe
wakes the idle scheduler process when it ends, and the next step hands the request on with its matcher (or fails it
with a 400 naming the problem, or the timeout of `--grammar-compile-timeout-s`). Under tensor parallelism every
rank must form the same batches, so there the compile is waited for where the request arrives.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from pdserve.config import ServerArgs
from pdserve.constrained.compiler import GrammarCompiler, GrammarError, GrammarSpec
from pdserve.constrained.matcher import RequestGrammar
from pdserve.scheduler.request import Req


@dataclass(slots=True, frozen=True)
class PendingGrammar:
    req: Req
    compiled: Future
    deadline: float  # time.monotonic() after which the request fails


@dataclass(slots=True, frozen=True)
class GrammarOutcome:
    """A request whose compile ended this step: its matcher, or why it fails."""

    req: Req
    grammar: RequestGrammar | None
    error: str | None


class GrammarQueue:
    def __init__(self, args: ServerArgs, model_config: Any, load_tokenizer: Callable[[], Any]):
        self.args = args
        self.model_config = model_config
        self.load_tokenizer = load_tokenizer
        self.compiler: GrammarCompiler | None = None  # built on the first grammar
        self.pending: list[PendingGrammar] = []
        self.num_submitted = 0
        self.wake_fd, self._wake_write_fd = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_write_fd, False)

    def submit(self, req: Req) -> None:
        """Start compiling req's grammar; raises GrammarError at once when this server cannot compile any."""
        kind, text = req.sampling_params.grammar
        future = self._compiler().submit(GrammarSpec(kind, text))
        timeout = self.args.grammar_compile_timeout_s
        if self.args.tp_size > 1:
            wait([future], timeout=timeout)
        future.add_done_callback(self._wake)
        self.pending.append(PendingGrammar(req, future, time.monotonic() + timeout))
        self.num_submitted += 1

    def compile_untimed(self, spec: GrammarSpec) -> None:
        """Compile `spec` now, however long it takes (the warm-up's grammar: the first compile also builds the
        tokenizer's tables, which --grammar-compile-timeout-s does not bound); requests for it then find it cached."""
        self._compiler().submit(spec).result()

    def _compiler(self) -> GrammarCompiler:
        if self.args.grammar_backend == "none":
            raise GrammarError("structured output is off on this server (--grammar-backend none)")
        if self.compiler is None:
            cfg = self.model_config
            self.compiler = GrammarCompiler(self.load_tokenizer, cfg.vocab_size, list(cfg.eos_token_ids),
                                            self.args.grammar_any_whitespace)
        return self.compiler

    def _wake(self, _: Future) -> None:
        try:
            os.write(self._wake_write_fd, b"x")
        except OSError:
            pass  # the pipe is full (the scheduler is awake already) or closed (the scheduler has stopped)

    def poll(self) -> list[GrammarOutcome]:
        """The requests whose compile ended or timed out since the last poll, in arrival order."""
        self._drain_wakeups()
        if not self.pending:
            return []
        now, outcomes, still = time.monotonic(), [], []
        for item in self.pending:
            outcome = _outcome(item, now, self.args.grammar_compile_timeout_s, self.compiler)
            (still if outcome is None else outcomes).append(item if outcome is None else outcome)
        self.pending = still
        return outcomes

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def remove(self, req: Req) -> None:
        self.pending = [item for item in self.pending if item.req is not req]

    def stats(self) -> dict:
        compiler = self.compiler
        return {"constrained_requests": self.num_submitted,
                "grammar_compiles": compiler.num_compiles if compiler else 0,
                "grammar_cache_hits": compiler.num_cache_hits if compiler else 0,
                "grammar_compile_seconds": round(compiler.compile_seconds, 6) if compiler else 0.0,
                "grammar_waiting": len(self.pending)}

    def reset_stats(self) -> None:
        """Counters and the compile cache start over (after the warm-up)."""
        self.num_submitted = 0
        if self.compiler is not None:
            self.compiler.reset()

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
        os.close(self.wake_fd)
        os.close(self._wake_write_fd)


def _outcome(item: PendingGrammar, now: float, timeout: float, compiler: GrammarCompiler) -> GrammarOutcome | None:
    if item.compiled.done():
        error = item.compiled.exception()
        if error is not None:
            return GrammarOutcome(item.req, None, str(error))
        return GrammarOutcome(item.req, RequestGrammar(item.compiled.result(), compiler.utf8_guard), None)
    if now >= item.deadline:
        return GrammarOutcome(item.req, None, f"the grammar did not compile within {timeout:g} s "
                                              "(--grammar-compile-timeout-s)")
    return None
