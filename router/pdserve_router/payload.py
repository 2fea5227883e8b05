"""Request shaping: batch size, routing key, bootstrap fields, request ids, input-logprob merging, SSE and errors."""

from __future__ import annotations

import json
import random
from typing import Any

from aiohttp import web

from .policies import RoutingKey
from .workers import Worker

MAX_BATCH_ITEMS = 4096
INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
SSE_DONE = b"data: [DONE]"
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
MAX_ID_CHARS = 512  # the servers' bound on request ids and model and user names
SHORT_FIELDS = ("rid", "model", "user")


class BadRequest(ValueError):
    """The client's request cannot be routed as sent (answered with 400)."""


# OpenAI's error types by status, as the servers answer them: any other 4xx is an invalid request, any 5xx a
# server error; `code` is always the HTTP status, an int.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_body(status: int, message: str) -> dict:
    err_type = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "code": status}}


def error_response(status: int, message: str, request_id: str | None = None) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.json_response(error_body(status, message), status=status, headers=headers)


def check_short_fields(request_id: str, body: dict) -> None:
    """A request id (header or `rid`), model or user name longer than MAX_ID_CHARS is refused at once."""
    if len(request_id) > MAX_ID_CHARS:
        raise BadRequest(f"X-Request-Id is longer than {MAX_ID_CHARS} characters")
    for key in SHORT_FIELDS:
        value = body.get(key)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and len(v) > MAX_ID_CHARS for v in values):
            raise BadRequest(f"'{key}' is longer than {MAX_ID_CHARS} characters")


def prompt_only(path: str, body: dict) -> bool:
    """A request for no new token (prompt logprobs at most): with nothing to hand over, one server runs it whole.
    /generate's nested `max_new_tokens` wins over its top-level one, per item of a batch."""
    if path != "/generate":
        limit = body.get("max_completion_tokens") if path == "/v1/chat/completions" else None
        return _is_zero(body.get("max_tokens") if limit is None else limit)
    params = body.get("sampling_params")
    items = params if isinstance(params, list) else [params]
    return all(_is_zero(p.get("max_new_tokens", body.get("max_new_tokens")) if isinstance(p, dict)
                        else body.get("max_new_tokens")) for p in items)


def _is_zero(value: Any) -> bool:
    return type(value) is int and value == 0


def batch_size(path: str, body: dict) -> int | None:
    """Items in a batched /generate, or for OpenAI routes `n` times the prompts (several only in /v1/completions);
    None for a single request."""
    if path == "/generate":
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            size = len(text)
        elif isinstance(ids, list) and ids and isinstance(ids[0], list):
            size = len(ids)
        else:
            return None
    else:
        size = body.get("n", 1)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise BadRequest("'n' must be a positive integer")
        if path == "/v1/completions":
            size *= completion_prompts(body.get("prompt"))
        if size == 1:
            return None
    if not 1 <= size <= MAX_BATCH_ITEMS:
        raise BadRequest(f"batch size must be between 1 and {MAX_BATCH_ITEMS}, got {size}")
    return size


def completion_prompts(prompt: Any) -> int:
    """Prompts in a /v1/completions `prompt`: a list of strings or of token lists is one per entry."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def routing_key(path: str, body: dict) -> RoutingKey | None:
    """The prompt (text or token ids) that cache-aware routing matches prefixes on."""
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        return "".join(_message_text(m) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt") if path == "/v1/completions" else body.get("text", body.get("input_ids"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return prompt
    return None  # malformed: routed anyway, and the server answers the 400


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(token) is int for token in value)


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return f"{message.get('role', '')}:{content}" if isinstance(content, str) else ""


def new_room() -> int:
    return random.getrandbits(63)


def bootstrap_fields(path: str, prefill: Worker, batch: int | None) -> dict:
    """The rendezvous fields for one attempt; /generate batches get one entry per item in each field."""
    if batch is None:
        return {"bootstrap_host": prefill.bootstrap_host, "bootstrap_port": prefill.bootstrap_port,
                "bootstrap_room": new_room()}
    if path == "/generate":
        return {"bootstrap_host": [prefill.bootstrap_host] * batch, "bootstrap_port": [prefill.bootstrap_port] * batch,
                "bootstrap_room": [new_room() for _ in range(batch)]}
    return {"bootstrap_host": prefill.bootstrap_host, "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": [new_room() for _ in range(batch)]}


def spliceable(raw: bytes) -> bool:
    """Whether `raw` (a body that parsed as a JSON object) is UTF-8 text `{...}` that fields can be appended to
    without decoding and re-encoding it (a BOM, UTF-16/32 or leading/trailing junk would not be)."""
    return raw[:1] == b"{" and raw[-1:] == b"}" or raw.strip()[:1] == b"{" and raw.rstrip()[-1:] == b"}"


def encode_body(raw: bytes | None, body: dict, extra: dict) -> bytes:
    """The request body to send: the client's bytes `raw` (None when they cannot be reused, see `spliceable`)
    with `extra`'s fields appended when none of them is already in `body`, else `body` updated and re-encoded."""
    if raw is not None:
        if not extra:
            return raw
        if not any(key in body for key in extra):
            fields = json.dumps(extra).encode()
            head = raw.rstrip()[:-1]
            return b"".join((head, b", " if body else b"", fields[1:]))
    return json.dumps({**body, **extra}).encode()


def attempt_rid(base: str, attempt: int) -> str:
    return base if attempt == 0 else f"{base}.r{attempt}"


def body_rids(client_rid: Any, request_id: str, batch: int | None, path: str, attempt: int) -> Any:
    """The `rid` for a /generate body: the client's when given, else derived from the request id; None elsewhere."""
    if path != "/generate":
        return None
    if client_rid is None:
        client_rid = request_id if batch is None else [f"{request_id}-{i}" for i in range(batch)]
    if isinstance(client_rid, list):
        if batch is None or len(client_rid) != batch or not all(isinstance(r, str) for r in client_rid):
            raise BadRequest("'rid' must be a list of strings with one entry per batch item")
        return [attempt_rid(r, attempt) for r in client_rid]
    if not isinstance(client_rid, str) or batch is not None:
        raise BadRequest("'rid' must be a string (or a list of strings for a batch)")
    return attempt_rid(client_rid, attempt)


def merge_input_logprobs(decode_item: Any, prefill_item: Any) -> None:
    """Prepend the prefill's input logprobs to the decode item's meta_info, in place (like mini_lb)."""
    if not isinstance(decode_item, dict) or not isinstance(prefill_item, dict):
        return
    prefill_meta = prefill_item.get("meta_info")
    if not isinstance(prefill_meta, dict):
        return
    decode_meta = decode_item.setdefault("meta_info", {})
    if not isinstance(decode_meta, dict):
        return
    for key in INPUT_LOGPROB_KEYS:
        head, tail = prefill_meta.get(key), decode_meta.get(key) or []
        if isinstance(head, list) and isinstance(tail, list):
            decode_meta[key] = head + tail


def merge_json_response(decode_body: bytes, prefill_body: bytes) -> bytes:
    decoded, prefilled = json.loads(decode_body), json.loads(prefill_body)
    if isinstance(decoded, list) and isinstance(prefilled, list):
        for d_item, p_item in zip(decoded, prefilled):
            merge_input_logprobs(d_item, p_item)
    else:
        merge_input_logprobs(decoded, prefilled)
    return json.dumps(decoded).encode()


def sse_events(data: bytes) -> list[dict]:
    """The JSON payloads of the `data:` events in an SSE body (skips [DONE] and anything unparsable)."""
    events = []
    for line in data.split(b"\n"):
        if line.startswith(b"data:") and not line.startswith(SSE_DONE):
            try:
                payload = json.loads(line[5:])
            except ValueError:
                continue
            if isinstance(payload, dict):
                events.append(payload)
    return events


def prefill_items_by_index(prefill_body: bytes, stream: bool) -> dict[int, dict]:
    """Per batch index, the prefill result that carries input logprobs (the last event of each index when streamed)."""
    if not stream:
        parsed = json.loads(prefill_body)
        items = parsed if isinstance(parsed, list) else [parsed]
        return {i: item for i, item in enumerate(items) if isinstance(item, dict)}
    by_index: dict[int, dict] = {}
    for event in sse_events(prefill_body):
        meta = event.get("meta_info")
        if isinstance(meta, dict) and any(k in meta for k in INPUT_LOGPROB_KEYS):
            by_index[event.get("index", 0) if isinstance(event.get("index", 0), int) else 0] = event
    return by_index


class FirstEventMerger:
    """Rewrites the first decode SSE event of each batch index to carry the prefill's input logprobs."""

    def __init__(self, prefill_items: dict[int, dict]):
        self.pending = dict(prefill_items)
        self.buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send now; an incomplete trailing event is held back while merges are pending."""
        if not self.pending:
            out, self.buffer = self.buffer + chunk, b""
            return out
        complete, sep, self.buffer = (self.buffer + chunk).rpartition(b"\n\n")
        if not sep:
            return b""
        return b"".join(self._rewrite(event) for event in complete.split(b"\n\n"))

    def flush(self) -> bytes:
        out, self.buffer = self.buffer, b""
        return out

    def _rewrite(self, event: bytes) -> bytes:
        if self.pending and event.startswith(b"data:") and not event.startswith(SSE_DONE):
            try:
                payload = json.loads(event[5:])
            except ValueError:
                return event + b"\n\n"
            index = payload.get("index", 0) if isinstance(payload, dict) else None
            if isinstance(index, int) and index in self.pending:
                merge_input_logprobs(payload, self.pending.pop(index))
                return b"data: " + json.dumps(payload).encode() + b"\n\n"
        return event + b"\n\n"
