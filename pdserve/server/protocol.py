"""Request bodies of the HTTP API (pydantic), and their translation to `SamplingParams`.

`/generate` follows SGLang's `GenerateReqInput` (unknown fields are errors); the OpenAI routes follow
OpenAI's schema plus the usual vLLM/SGLang sampling extensions, ignore unknown fields as OpenAI
clients expect, and refuse the OpenAI features this server does not implement.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.sampling_params import MAX_INT32, MAX_TOP_LOGPROBS, SamplingParams

MAX_N = 16
MAX_ROOM = 2**63 - 1


class SamplingFields(BaseModel):
    """SGLang's sampling_params object; every field optional so that set fields can be merged."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(default=None, ge=0)
    min_new_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    sampling_seed: int | None = None


_SGLANG_TO_ENGINE = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}


def sglang_sampling_params(top_level: SamplingFields, nested: SamplingFields | None) -> SamplingParams:
    """Fields set in `sampling_params` win over the same fields given at the top level of the body."""
    values = _set_fields(top_level, SamplingFields)
    if nested is not None:
        values.update(_set_fields(nested, SamplingFields))
    return SamplingParams(**{_SGLANG_TO_ENGINE.get(k, k): v for k, v in values.items()})


def _set_fields(model: BaseModel, schema: type[BaseModel]) -> dict[str, Any]:
    return {name: getattr(model, name) for name in schema.model_fields if getattr(model, name) is not None}


class BootstrapFields(BaseModel):
    """PD rendezvous fields; the router sets them, one per prompt for batches."""

    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None


class GenerateReqInput(SamplingFields, BootstrapFields):
    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingFields | list[SamplingFields] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: int = Field(default=-1, ge=-1, le=MAX_INT32)
    return_text_in_logprobs: bool = True
    rid: str | list[str] | None = None

    @property
    def batch_size(self) -> int | None:
        """None for a single prompt."""
        prompts = self.text if self.text is not None else self.input_ids
        if isinstance(prompts, list) and (not prompts or isinstance(prompts[0], (str, list))):
            return len(prompts)
        return None


class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAIRequestBase(BootstrapFields):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM / SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    rid: str | None = None

    def unsupported_feature(self) -> str | None:
        """The first requested OpenAI feature this server does not implement, if any."""
        extra = self.model_extra or {}
        for name in ("tools", "functions", "logit_bias", "suffix", "audio", "prediction"):
            if extra.get(name):
                return name
        if extra.get("echo"):
            return "echo"
        if (extra.get("best_of") or 1) != 1:
            return "best_of"
        response_format = extra.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
            return "response_format"
        if extra.get("tool_choice") not in (None, "none"):
            return "tool_choice"
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, seed_offset: int = 0) -> SamplingParams:
        values: dict[str, Any] = {
            name: getattr(self, name)
            for name in (
                "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens", "stop_token_ids", "stop",
            )
            if getattr(self, name) is not None
        }
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        if self.seed is not None:
            values["seed"] = (self.seed + seed_offset) % 2**63
        if logprobs is not None:
            values["logprobs"] = logprobs
        return SamplingParams(**values)


class CompletionRequest(OpenAIRequestBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(OpenAIRequestBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class AbortRequestInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = ""
    abort_all: bool = False


def bootstrap_for(fields: BootstrapFields, index: int) -> tuple[str | None, int | None, int | None]:
    """Item `index`'s (host, port, room): a list gives one per prompt, a scalar is shared."""

    def pick(value: Any) -> Any:
        if isinstance(value, list):
            if index >= len(value):
                raise ValueError(f"bootstrap lists are shorter than the batch (item {index})")
            return value[index]
        return value

    host, port, room = pick(fields.bootstrap_host), pick(fields.bootstrap_port), pick(fields.bootstrap_room)
    if room is not None and not 0 <= room <= MAX_ROOM:
        raise ValueError(f"bootstrap_room must be in [0, 2^63), got {room}")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"bootstrap_port must be in 1..65535, got {port}")
    return host, port, room
