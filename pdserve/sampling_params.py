"""Per-request sampling parameters (vLLM/SGLang vocabulary)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")  # SGLang's names of an output constraint
MAX_INT32 = 2**31 - 1


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the server maps it to HTTP 400."""


class PromptError(ValueError):
    """A prompt the model cannot take."""


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 128
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # n-best logprobs per output token (0 = only the sampled one)
    prompt_logprobs: int | None = None  # n-best logprobs per prompt token
    logprob_start_len: int = -1  # first prompt position whose logprob is returned (-1: none)
    # an output constraint (at most one; `pdserve/constrained/`): its text as SGLang takes it
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or self.prompt_logprobs is not None

    @property
    def top_logprobs_num(self) -> int:
        return max(self.logprobs or 0, self.prompt_logprobs or 0)

    @property
    def first_prompt_logprob(self) -> int:
        """The first prompt position whose logprob is returned; -1 for none."""
        if self.logprob_start_len >= 0:
            return self.logprob_start_len
        return 0 if self.prompt_logprobs is not None else -1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, or None for free output."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> None:
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
        checks = [
            *((math.isfinite(getattr(self, name)), f"{name} must be a finite number, got {getattr(self, name)}")
              for name in floats),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (self.temperature <= 100.0, f"temperature must be <= 100, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or 1 <= self.top_k <= MAX_INT32, f"top_k must be -1 (off) or in [1, 2^31), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (0 <= self.max_tokens <= MAX_INT32, f"max_tokens must be in [0, 2^31), got {self.max_tokens}"),
            (0 <= self.min_tokens <= max(self.max_tokens, 0), f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (len(self.stop) <= 16, f"at most 16 stop strings, got {len(self.stop)}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative ints"),
            (self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2^63), got {self.seed}"),
        ]
        grammars = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        checks += [
            (len(grammars) <= 1, f"at most one of {', '.join(GRAMMAR_KINDS)} may be given, got {', '.join(grammars)}"),
            (all(isinstance(getattr(self, k), str) for k in grammars), "a grammar (json_schema, ...) must be a string"),
        ]
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            checks.append(
                (value is None or 0 <= value <= MAX_TOP_LOGPROBS, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
            )
        for ok, message in checks:
            if not ok:
                raise SamplingParamsError(message)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        return cls(**data)


def check_prompt(input_ids: Sequence[int], params: SamplingParams, vocab_size: int, context_len: int) -> None:
    """The one check of a request against the model, where it enters the engine (the HTTP server's tokenizer
    manager, or the offline `LLM`): every token id the client gave lies in the vocabulary, the prompt leaves room
    for an output token, and max_tokens (and min_tokens with it) is clamped to that room."""
    if not input_ids:
        raise PromptError("the prompt is empty")
    for name, ids in (("input_ids", input_ids), ("stop_token_ids", params.stop_token_ids)):
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise PromptError(f"{name} must be token ids in the vocabulary [0, {vocab_size})")
    room = context_len - len(input_ids)
    if room <= 0:
        raise PromptError(
            f"the prompt has {len(input_ids)} tokens; this model's context length is {context_len}, "
            "so it must be shorter to leave room for at least one output token"
        )
    params.max_tokens = min(params.max_tokens, room)
    params.min_tokens = min(params.min_tokens, params.max_tokens)
