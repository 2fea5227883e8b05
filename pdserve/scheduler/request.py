"""A request inside the scheduler: what it asked for, its stop conditions and its state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pdserve.constrained.matcher import RequestGrammar
from pdserve.sampling_params import SamplingParams
from pdserve.timeline import StageMarks


class ReqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None  # for aborts: why
    status_code: int | None = None  # for aborts that are the server's failure, not the client's: the HTTP status

    def to_dict(self) -> dict:
        out: dict = {"type": self.type}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


@dataclass(slots=True, frozen=True)
class StopCriteria:
    """One request's stop conditions, resolved once (at its first check): a token then costs a length compare
    and a set lookup, and stop strings are matched only for the requests that have them."""

    stop_ids: frozenset[int]  # the stop token ids, EOS included unless ignore_eos
    min_tokens: int  # no stop token or string counts before this many output tokens
    max_output_len: int  # max_tokens, already clamped to the room the context leaves
    stop_strings: tuple[str, ...]


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    # PD rendezvous (set by the router; None on a colocated server)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    # scheduler state
    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # KV pages, in token order
    num_cached_tokens: int = 0  # tokens whose KV is in `pages` and computed
    num_prefix_hit: int = 0  # tokens reused from the radix cache at admission
    finish_reason: FinishReason | None = None
    num_reported: int = 0  # output tokens already reported in a TokenOut
    stop_criteria: StopCriteria | None = None  # resolved by the StopChecker at the first check
    grammar: RequestGrammar | None = None  # the output constraint's matcher, once compiled
    stage_marks: StageMarks = field(default_factory=StageMarks)  # the scheduler's and its role's timeline marks

    @classmethod
    def of(cls, rid: str, input_ids: list[int], params: SamplingParams, **kw) -> Req:
        """A request whose logprob settings follow from its sampling parameters."""
        return cls(rid, input_ids, params, return_logprob=params.wants_logprobs,
                   top_logprobs_num=params.top_logprobs_num, logprob_start_len=params.first_prompt_logprob, **kw)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

