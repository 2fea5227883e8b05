"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.sampling_params import SamplingParamsError
from pdserve.server.generation import (
    Generation,
    check_batch_size,
    settle_bootstrap,
    check_prompt_sizes,
    check_unique_rids,
    collect,
    new_rid,
    output_stream,
    sampling_error,
    with_logprobs,
)
from pdserve.server.http_common import ARGS_KEY, EXCHANGE_KEY, TM_KEY, ApiError, json_response, parse_body
from pdserve.server.http_common import stream_with_early_errors
from pdserve.server.prefix_digest import chat_routing_key
from pdserve.server.schemas import (MAX_ID_CHARS, ChatCompletionRequest, CompletionRequest, OpenAIRequestBase,
                                    bootstrap_for)
from pdserve.server.tokenizer_manager import GenerateRequest, OutputDelta, TokenizerManager, merge_streams
from pdserve.server.tool_call_parser import (CallStart, Content, Piece, ToolCallStream, parse_tool_calls,
                                            tool_call_stream)
from pdserve.server.tool_calls import ToolChoice, pick_tool_call_parser
from pdserve.tokenizer import TokenBytes

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
REQUEST_ID_HEADER = "X-Request-Id"  # the router's id of a request, sent to both servers of a PD pair
MAX_IGNORED_NAMES_LOGGED = 256  # a client sending ever new names cannot grow the set or the log without bound
logger = logging.getLogger(__name__)
_ignored_names_logged: set[str] = set()


async def completions(request: web.Request) -> web.StreamResponse:
    tm, args = request.app[TM_KEY], request.app[ARGS_KEY]
    body = await parse_body(request, CompletionRequest)
    _check_common(args, body)
    texts = _prompt_list(body.prompt)
    check_batch_size(args, len(texts) * body.n)
    check_prompt_sizes(tm, texts)
    prompts = await tm.encode_prompts(texts)
    top_n = body.logprobs
    ids = RequestIds.of(request, body, "cmpl")
    requests = await _requests(args, tm, body, prompts, texts, body.max_tokens, top_n, ids.rid)
    return await _respond(request, body, requests, CompletionFormat(args.model_name, requests, ids.response))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    tm, args = request.app[TM_KEY], request.app[ARGS_KEY]
    body = await parse_body(request, ChatCompletionRequest)
    _check_common(args, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true")
    check_batch_size(args, body.n)
    tool_choice = _tool_choice(body)
    input_ids = await tm.encode_chat([m.to_template() for m in body.messages], body.template_kwargs())
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    key = chat_routing_key(body.messages)
    ids = RequestIds.of(request, body, "chatcmpl")
    requests = await _requests(args, tm, body, [input_ids], [key], body.output_limit, top_n, ids.rid)
    parser = pick_tool_call_parser(args.tool_call_parser, getattr(tm.tokenizer, "chat_template", None))
    return await _respond(request, body, requests,
                          ChatFormat(args.model_name, requests, ids.response, tool_choice, parser, tm.token_bytes))


@dataclass(frozen=True, slots=True)
class RequestIds:
    """`rid`: the id every process of the cluster logs the request by (its timeline line, the router's too);
    `response`: the answer's `id`."""

    rid: str
    response: str

    @classmethod
    def of(cls, request: web.Request, body: OpenAIRequestBase, prefix: str) -> RequestIds:
        """The client's `rid` is both. Else the router's `X-Request-Id` (the same on the prefill and the decode
        server) is the rid, and the answer's id carries OpenAI's `cmpl-` or `chatcmpl-` before it; else a new id."""
        if body.rid:
            return cls(body.rid, body.rid)
        header = request.headers.get(REQUEST_ID_HEADER)
        if not header:
            rid = f"{prefix}-{new_rid()}"
            return cls(rid, rid)
        if len(header) > MAX_ID_CHARS:
            raise ApiError(400, f"the {REQUEST_ID_HEADER} header has more than {MAX_ID_CHARS} characters")
        return cls(header, f"{prefix}-{header}")


def _tool_choice(body: ChatCompletionRequest) -> ToolChoice:
    try:
        return body.tool_choice_spec
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


async def list_models(request: web.Request) -> web.Response:
    tm, args = request.app[TM_KEY], request.app[ARGS_KEY]
    card = {"id": args.model_name, "object": "model", "created": int(_START_TIME), "owned_by": "pdserve",
            "root": args.model_path, "max_model_len": tm.context_length}
    return json_response({"object": "list", "data": [card]})


_START_TIME = time.time()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)


# --- requests ---------------------------------------------------------------------------------------


def _check_common(args: Any, body: OpenAIRequestBase) -> None:
    if body.model not in (args.model_name, args.model_path):
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {args.model_name!r}")
    feature = body.unsupported_feature()
    if feature is not None:
        raise ApiError(400, f"{feature} is not supported by this server")
    _log_ignored_fields(body)


def _log_ignored_fields(body: OpenAIRequestBase) -> None:
    """The /v1 routes accept fields they do not know (the SDK's `extra_body` sends them), and say so once per name."""
    names = [*(body.model_extra or {}), *(f"messages[].{name}" for message in getattr(body, "messages", ())
                                          for name in message.model_extra or {})]
    for name in names:
        if name not in _ignored_names_logged and len(_ignored_names_logged) < MAX_IGNORED_NAMES_LOGGED:
            _ignored_names_logged.add(name)
            logger.warning("the request field %r is not implemented and was ignored (said once per field name)",
                           name[:100])


def _prompt_list(prompt: Any) -> list:
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise ApiError(400, "the prompt is empty")
    return prompt


async def _requests(
    args: Any, tm: TokenizerManager, body: OpenAIRequestBase, prompts: list[list[int]], keys: list,
    max_tokens: int | None, top_n: int | None, base: str,
) -> list[GenerateRequest]:
    """n requests per prompt, in OpenAI's choice order (prompt-major), their rids `base` or `base-i`; `keys`: each
    prompt's routing key."""
    total = len(prompts) * body.n
    requests = []
    for index in range(total):
        input_ids = prompts[index // body.n]
        try:
            limit = tm.context_length if max_tokens is None else max_tokens
            params = body.sampling_params(limit, top_n, seed_offset=index % body.n)
            host, port, room = bootstrap_for(body, index)
        except (SamplingParamsError, TypeError) as exc:
            raise sampling_error(exc) from exc
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        rid = base if total == 1 else f"{base}-{index}"
        req = GenerateRequest(rid, input_ids, params, bootstrap_host=host, bootstrap_port=port,
                              bootstrap_room=room, routing_key=keys[index // body.n])
        with_logprobs(req, top_n is not None, top_n or 0, -1)
        settle_bootstrap(tm.args, req)  # the role it serves now (a role switch changes it)
        requests.append(req)
    await tm.check_requests(requests)
    check_unique_rids(tm, requests)
    return requests


async def _respond(
    request: web.Request, body: OpenAIRequestBase, requests: list[GenerateRequest], fmt: "ResponseFormat"
) -> web.StreamResponse:
    tm = request.app[TM_KEY]
    streams = [output_stream(tm, r, body.stream, request[EXCHANGE_KEY]) for r in requests]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_with_early_errors(request, fmt.events(streams, body.n, include_usage))
    generations = await collect(streams)
    return json_response(fmt.response(generations, body.n))


def _usage(generations: list[Generation], n: int) -> dict:
    prompt = sum(g.prompt_tokens for g in generations[::n])
    completion = sum(g.completion_tokens for g in generations)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(reason: dict | None) -> str | None:
    return None if reason is None else _FINISH_REASONS.get(reason.get("type"), reason.get("type"))


# --- response shapes --------------------------------------------------------------------------------


class ResponseFormat(ABC):
    object_name = ""
    chunk_object_name = ""

    def __init__(self, model: str, requests: list[GenerateRequest], response_id: str):
        self.model = model
        self.id = response_id
        self.created = int(time.time())
        self.logprobs = requests[0].sampling_params.wants_logprobs

    def envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def response(self, generations: list[Generation], n: int) -> dict:
        choices = [self.choice(i, g) for i, g in enumerate(generations)]
        return {**self.envelope(self.object_name, choices), "usage": _usage(generations, n)}

    async def events(
        self, streams: list[AsyncIterator[OutputDelta]], n: int, include_usage: bool
    ) -> AsyncIterator[dict]:
        generations = [Generation() for _ in streams]
        async with aclosing(merge_streams(streams)) as merged:
            async for index, delta in merged:
                is_first = generations[index].last is None
                generations[index].add(delta)
                for choice in self.delta_choices(index, delta, is_first):
                    yield self.envelope(self.chunk_object_name, [choice])
        if include_usage:
            yield {**self.envelope(self.chunk_object_name, []), "usage": _usage(generations, n)}

    @abstractmethod
    def choice(self, index: int, generation: Generation) -> dict: ...

    @abstractmethod
    def delta_choices(self, index: int, delta: OutputDelta, is_first: bool) -> list[dict]: ...


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def choice(self, index: int, generation: Generation) -> dict:
        logprobs = None
        if self.logprobs:
            logprobs = completion_logprobs(generation.output_logprobs, generation.output_top_logprobs, 0)
        return {"index": index, "text": generation.text, "logprobs": logprobs,
                "finish_reason": _finish_reason(generation.finish_reason)}

    def delta_choices(self, index: int, delta: OutputDelta, is_first: bool) -> list[dict]:
        out = delta.out
        if not out.text and not delta.finished and not out.output_logprobs:
            return []
        logprobs = None
        if out.output_logprobs:
            logprobs = completion_logprobs(out.output_logprobs, out.output_top_logprobs, 0)
        return [{"index": index, "text": out.text, "logprobs": logprobs,
                 "finish_reason": _finish_reason(out.finish_reason)}]


class ChatFormat(ResponseFormat):
    """Chat answers. With tools, each choice's text goes through a tool-call parser (`tool_call_parser.py`): streamed,
    content and each call's start and arguments arrive as OpenAI's deltas as soon as they are decided; blocking, the
    same parser reads the whole text, so the deltas of a stream add up to the blocking answer."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, model: str, requests: list[GenerateRequest], response_id: str, tool_choice: ToolChoice,
                 tool_call_parser: str, token_bytes: TokenBytes):
        super().__init__(model, requests, response_id)
        self.tool_choice = tool_choice
        self.tool_call_parser = tool_call_parser
        self.token_bytes = token_bytes
        self._parsers: dict[int, ToolCallStream] = {}  # streamed: each choice's parser

    def choice(self, index: int, generation: Generation) -> dict:
        logprobs = None
        if self.logprobs:
            logprobs = {"content": chat_logprobs(generation.output_logprobs, generation.output_top_logprobs,
                                                     self.token_bytes)}
        content, tool_calls = parse_tool_calls(generation.text, self.tool_choice, self.tool_call_parser)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish_reason = _tool_finish_reason(generation.finish_reason, bool(tool_calls))
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta_choices(self, index: int, delta: OutputDelta, is_first: bool) -> list[dict]:
        parser = self._parsers.setdefault(index, tool_call_stream(self.tool_choice, self.tool_call_parser))
        out = delta.out
        messages = [_delta_message(piece) for piece in parser.feed(out.text)]
        if delta.finished:
            messages += [_delta_message(piece) for piece in parser.finish()]
            del self._parsers[index]
        if (delta.finished or out.output_logprobs) and not messages:
            messages.append({})
        choices = [{"index": index, "delta": message, "logprobs": None, "finish_reason": None} for message in messages]
        if choices and out.output_logprobs:
            choices[0]["logprobs"] = {"content": chat_logprobs(out.output_logprobs, out.output_top_logprobs,
                                                               self.token_bytes)}
        if delta.finished:
            choices[-1]["finish_reason"] = _tool_finish_reason(out.finish_reason, parser.num_calls > 0)
        return ([_role_chunk(index, self.tool_choice.mode == "none")] if is_first else []) + choices


def _tool_finish_reason(reason: dict | None, has_calls: bool) -> str | None:
    finish_reason = _finish_reason(reason)
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


def _delta_message(piece: Piece) -> dict:
    """OpenAI's delta of one parsed piece: content, a call's start (id, name, empty arguments) or its arguments."""
    if isinstance(piece, Content):
        return {"content": piece.text}
    if isinstance(piece, CallStart):
        call = {"index": piece.index, "id": piece.id, "type": "function",
                "function": {"name": piece.name, "arguments": ""}}
    else:
        call = {"index": piece.index, "function": {"arguments": piece.text}}
    return {"tool_calls": [call]}


def _role_chunk(index: int, plain: bool) -> dict:
    """The first chunk of a choice; with tools its content starts as null (as OpenAI's, and the blocking answer's
    where the model only called tools)."""
    delta = {"role": "assistant", "content": "" if plain else None}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


def completion_logprobs(entries: list[list], top: list[list[list]], text_offset: int) -> dict:
    tokens = [e[2] for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e[0] for e in entries],
        "top_logprobs": [{t[2]: t[0] for t in alternatives} for alternatives in top] or None,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[list], top: list[list[list]], token_bytes: TokenBytes) -> list[dict]:
    """OpenAI's chat logprobs from [logprob, token id, text] entries; `bytes` are the token's own bytes."""
    content = []
    for position, (logprob, token_id, token) in enumerate(entries):
        alternatives = top[position] if position < len(top) else []
        content.append({
            "token": token, "logprob": logprob, "bytes": list(token_bytes(token_id, token)),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(token_bytes(tid, t))}
                             for lp, tid, t in alternatives],
        })
    return content
