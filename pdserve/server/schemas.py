"""Request bodies of the HTTP API (pydantic), and their translation to `SamplingParams`.

`/generate` follows SGLang's `GenerateReqInput`: every SGLang field is accepted, those pdserve does not implement
only at a value that asks for nothing (`unsupported_feature`), unknown fields are errors. The OpenAI routes follow
OpenAI's schema plus the usual vLLM/SGLang sampling extensions, ignore unknown fields as OpenAI
clients expect, and refuse the OpenAI features this server does not implement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, create_model

from pdserve.sampling_params import MAX_INT32, MAX_TOP_LOGPROBS, SamplingParams
from pdserve.server.tool_calls import ToolChoice, response_format_schema, tool_call_schema, tool_choice_of

MAX_N = 16
MAX_ROOM = 2**63 - 1
MAX_ID_CHARS = 512  # request ids, model and user names, bootstrap hosts: a longer one is refused with a 400
ShortStr = Annotated[str, StringConstraints(max_length=MAX_ID_CHARS)]


def _absent(value: Any) -> bool:
    """None, False, an empty value, or a per-item list of those: a field that asks for nothing."""
    items = value if isinstance(value, list) else [value]
    return all(v is None or v is False or (isinstance(v, (str, dict, list)) and not v) for v in items)


def _rank_zero(value: Any) -> bool:
    return value is None or value == 0  # pdserve runs one data-parallel rank


class EngineSamplingFields(BaseModel):
    """The fields of SGLang's sampling_params object that pdserve implements; every field optional so that set
    fields can be merged."""

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
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None


# sampling_params fields of SGLang that pdserve does not implement, with the test of a value that asks for nothing
NEUTRAL_SGLANG_SAMPLING_FIELDS: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(("stop_regex", "logit_bias", "custom_params", "no_stop_trim", "watermark", "ebnf_full_assistant"),
                    _absent),
    "n": lambda value: value in (None, 1),
    "beam_width": lambda value: value in (None, 1),
    "spaces_between_special_tokens": lambda value: value in (None, True),
}


class SamplingFields(EngineSamplingFields):
    """SGLang's whole sampling_params object."""

    stop_regex: Any = None
    logit_bias: Any = None
    custom_params: Any = None
    no_stop_trim: Any = None
    n: Any = None
    beam_width: Any = None
    watermark: Any = None
    ebnf_full_assistant: Any = None
    spaces_between_special_tokens: Any = None
    stream_interval: int | None = None  # streaming cadence in tokens; None: the server's --stream-interval

    def unsupported_feature(self) -> str | None:
        return first_unsupported(self, NEUTRAL_SGLANG_SAMPLING_FIELDS)


_SGLANG_TO_ENGINE = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}


def sglang_sampling_params(top_level: SamplingFields, nested: SamplingFields | None) -> SamplingParams:
    """Fields set in `sampling_params` win over the same fields given at the top level of the body."""
    values = _set_fields(top_level, EngineSamplingFields)
    if nested is not None:
        values.update(_set_fields(nested, EngineSamplingFields))
    return SamplingParams(**{_SGLANG_TO_ENGINE.get(k, k): v for k, v in values.items()})


def _set_fields(model: BaseModel, schema: type[BaseModel]) -> dict[str, Any]:
    return {name: getattr(model, name) for name in schema.model_fields if getattr(model, name) is not None}


class BootstrapFields(BaseModel):
    """PD rendezvous fields; the router sets them, one per prompt for batches."""

    bootstrap_host: ShortStr | list[ShortStr] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None


# SGLang `GenerateReqInput` fields that pdserve accepts but does not implement, each with the test of a value that
# asks for nothing; any other value is refused with a 400 naming the field.
NEUTRAL_SGLANG_FIELDS: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys((
        "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
        "use_audio_in_video", "video_config", "token_ids_logprob", "return_sampling_mask",
        "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64", "return_hidden_states",
        "return_routed_experts", "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
        "custom_logit_processor", "positional_embed_overrides", "kv_router_hint", "background", "require_reasoning",
        "max_thinking_tokens", "priority", "extra_key", "cache_salt", "custom_labels", "return_bytes",
        "return_entropy", "return_prompt_token_ids", "need_wait_for_mm_inputs", "num_items_assigned",
        "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
        "video_max_dynamic_patch", "images_config", "multi_item_delimiter_indices", "sampling_logprobs_mode",
        "return_flat_raw_output_top_logprobs", "mm_processor_kwargs", "token_indices_to_pool", "kv_hints",
    ), _absent),
    **dict.fromkeys(("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"), _rank_zero),
}
# SGLang fields that only describe the request (identity, routing hints, tracing, logging): accepted and ignored
INFORMATIONAL_SGLANG_FIELDS = (
    "session_id", "log_metrics", "routed_experts_start_len", "bootstrap_pair_key", "decode_tp_size",
    "routing_key", "conversation_id", "http_worker_ipc", "no_logs", "external_trace_header", "received_time",
)


def first_unsupported(model: BaseModel, neutral_fields: dict[str, Callable[[Any], bool]]) -> str | None:
    """The first of `neutral_fields` whose value in `model` asks for something pdserve lacks, with that value."""
    for name, neutral in neutral_fields.items():
        value = getattr(model, name)
        if not neutral(value):
            return f"{name}={value!r}"[:200]
    return None


# the rest of SGLang's `GenerateReqInput`, so that SGLang's own clients (bench_serving, its router) send their bodies
SGLangOnlyFields = create_model(
    "SGLangOnlyFields", __config__=ConfigDict(extra="forbid"),
    **{name: (Any, None) for name in (*NEUTRAL_SGLANG_FIELDS, *INFORMATIONAL_SGLANG_FIELDS)},
)


class GenerateReqInput(SamplingFields, BootstrapFields, SGLangOnlyFields):
    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingFields | list[SamplingFields] | None = None
    stream: bool = False
    return_logprob: bool | None = None
    top_logprobs_num: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    return_text_in_logprobs: bool = True
    rid: ShortStr | list[ShortStr] | None = None

    def unsupported_feature(self) -> str | None:
        nested = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params]
        found = [first_unsupported(self, NEUTRAL_SGLANG_FIELDS), SamplingFields.unsupported_feature(self),
                 *(fields.unsupported_feature() for fields in nested if fields is not None)]
        return next((feature for feature in found if feature is not None), None)

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

    model: ShortStr
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
    user: ShortStr | None = None
    # vLLM / SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    rid: ShortStr | None = None
    response_format: dict[str, Any] | None = None
    regex: str | None = None  # SGLang's grammar extensions of the OpenAI routes
    ebnf: str | None = None

    def unsupported_feature(self) -> str | None:
        """The first requested OpenAI feature this server does not implement, if any."""
        extra = self.model_extra or {}
        for name in ("functions", "logit_bias", "suffix", "audio", "prediction"):
            if extra.get(name):
                return name
        if extra.get("echo"):
            return "echo"
        if (extra.get("best_of") or 1) != 1:
            return "best_of"
        return None

    def output_schema(self) -> str | None:
        """The JSON schema text the output is constrained to (ValueError for a bad response_format)."""
        return response_format_schema(self.response_format)

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
        schema = self.output_schema()
        if schema is not None:
            values["json_schema"] = schema
        values.update({name: getattr(self, name) for name in ("regex", "ebnf") if getattr(self, name) is not None})
        return SamplingParams(**values)


class CompletionRequest(OpenAIRequestBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def unsupported_feature(self) -> str | None:
        extra = self.model_extra or {}
        for name in ("tools", "tool_choice"):  # tools are a chat feature
            if extra.get(name):
                return name
        return super().unsupported_feature()


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        for field in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, field):
                message[field] = getattr(self, field)
        return message


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: ShortStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatCompletionRequest(OpenAIRequestBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @property
    def tool_dicts(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    @property
    def tool_choice_spec(self) -> ToolChoice:
        """ValueError for a tool_choice that does not fit the tools."""
        return tool_choice_of(self.tool_choice, self.tool_dicts)

    def output_schema(self) -> str | None:
        schema = tool_call_schema(self.tool_choice_spec, self.tool_dicts, self.parallel_tool_calls)
        if schema is not None and self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("give either response_format or a tool_choice that forces a call, not both")
        return schema if schema is not None else super().output_schema()

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra arguments: the tools (unless tool_choice is none), then the client's own."""
        offered = {"tools": self.tool_dicts} if self.tools and self.tool_choice_spec.mode != "none" else {}
        return {**offered, **(self.chat_template_kwargs or {})}

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class AbortRequestInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: ShortStr = ""
    abort_all: bool = False


def bootstrap_for(fields: BootstrapFields, index: int) -> tuple[str | None, int | None, int | None]:
    """Item `index`'s (host, port, room): a list gives one per prompt; a scalar host or port is shared and a scalar
    room r gives item i the room r + i (as SGLang does), so no two items of a batch share a room."""

    def pick(value: Any) -> Any:
        if isinstance(value, list):
            if index >= len(value):
                raise ValueError(f"bootstrap lists are shorter than the batch (item {index})")
            return value[index]
        return value

    host, port, room = pick(fields.bootstrap_host), pick(fields.bootstrap_port), pick(fields.bootstrap_room)
    if room is not None and not 0 <= room <= MAX_ROOM:
        raise ValueError(f"bootstrap_room must be in [0, 2^63), got {room}")
    if room is not None and not isinstance(fields.bootstrap_room, list):
        room = (room + index) % (MAX_ROOM + 1)  # SGLang's rule: a scalar room gives item i the room + i
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"bootstrap_port must be in 1..65535, got {port}")
    return host, port, room
