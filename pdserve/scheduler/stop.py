"""When a request stops: EOS, stop token ids, stop strings, max_tokens, context length."""

from __future__ import annotations

from pdserve.config import ServerArgs
from pdserve.models.model_config import ModelConfig
from pdserve.scheduler.request import FinishReason, Req, StopCriteria
from pdserve.tokenizer import load_tokenizer


class StopChecker:
    def __init__(self, args: ServerArgs, model_config: ModelConfig, tokenizer=None):
        self.tokenizer = tokenizer
        self._args = args
        self.eos_ids = set(model_config.eos_token_ids)

    def _tok(self):
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self._args)
        return self.tokenizer

    def criteria(self, req: Req) -> StopCriteria:
        """The request's StopCriteria, built on first use (its sampling parameters are final by then)."""
        if req.stop_criteria is None:
            p = req.sampling_params
            stop_ids = set(p.stop_token_ids) if p.ignore_eos else self.eos_ids.union(p.stop_token_ids)
            req.stop_criteria = StopCriteria(frozenset(stop_ids), p.min_tokens, p.max_tokens, tuple(p.stop))
        return req.stop_criteria

    def suppressed_ids(self, req: Req) -> list[int]:
        c = req.stop_criteria or self.criteria(req)
        if len(req.output_ids) >= c.min_tokens:
            return []
        return sorted(c.stop_ids)

    def check(self, req: Req) -> FinishReason | None:
        c = req.stop_criteria or self.criteria(req)
        n = len(req.output_ids)
        if req.grammar is not None and req.grammar.terminated:  # ignore_eos or not: nothing more may follow
            return FinishReason("stop", matched=req.output_ids[-1])
        if n >= c.min_tokens:
            token = req.output_ids[-1]
            if token in c.stop_ids:
                return FinishReason("stop", matched=token)
            if c.stop_strings:
                matched = self._stop_string(req.output_ids, c.stop_strings)
                if matched is not None:
                    return FinishReason("stop", matched=matched)
        if n >= c.max_output_len:
            return FinishReason("length")
        return None

    def _stop_string(self, output_ids: list[int], stops: tuple[str, ...]) -> str | None:
        """A stop string ending inside the newest token (decoded from a tail long enough to contain it)."""
        longest = max(len(s) for s in stops)
        tail_tokens = output_ids[-(longest + 8) :]
        tail = self._tok().decode(tail_tokens, skip_special_tokens=False)
        prev = self._tok().decode(tail_tokens[:-1], skip_special_tokens=False)
        for stop in stops:
            if stop in tail and stop not in prev:
                return stop
        return None
