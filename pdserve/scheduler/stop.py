"""When a request stops: EOS, stop token ids, stop strings, max_tokens, context length."""

from __future__ import annotations

from pdserve.config import ServerArgs
from pdserve.models.model_config import ModelConfig
from pdserve.scheduler.request import FinishReason, Req


def load_tokenizer(args: ServerArgs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)


class StopChecker:
    def __init__(self, args: ServerArgs, model_config: ModelConfig, context_len: int, tokenizer=None):
        self.tokenizer = tokenizer
        self._args = args
        self.eos_ids = set(model_config.eos_token_ids)
        self.context_len = context_len

    def _tok(self):
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self._args)
        return self.tokenizer

    def suppressed_ids(self, req: Req) -> list[int]:
        p = req.sampling_params
        if len(req.output_ids) >= p.min_tokens:
            return []
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids |= self.eos_ids
        return sorted(ids)

    def check(self, req: Req) -> FinishReason | None:
        p = req.sampling_params
        token = req.output_ids[-1]
        if len(req.output_ids) >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_ids:
                return FinishReason("stop", matched=token)
            if token in p.stop_token_ids:
                return FinishReason("stop", matched=token)
            if p.stop:
                matched = self._stop_string(req)
                if matched is not None:
                    return FinishReason("stop", matched=matched)
        if len(req.output_ids) >= p.max_tokens or req.seq_len >= self.context_len:
            return FinishReason("length")
        return None

    def _stop_string(self, req: Req) -> str | None:
        """A stop string ending inside the newest token (decoded from a tail long enough to contain it)."""
        stops = req.sampling_params.stop
        longest = max(len(s) for s in stops)
        tail_tokens = req.output_ids[-(longest + 8) :]
        tail = self._tok().decode(tail_tokens, skip_special_tokens=False)
        prev = self._tok().decode(tail_tokens[:-1], skip_special_tokens=False)
        for stop in stops:
            if stop in tail and stop not in prev:
                return stop
        return None
