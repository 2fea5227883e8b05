"""SGLang's native routes: /generate, health, model and server info, cache flush, abort, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from pdserve.messages import FAKE_BOOTSTRAP_HOST
from pdserve.sampling_params import SamplingParams, SamplingParamsError
from pdserve.server.generation import Generation, check_batch_size, settle_bootstrap, check_prompt_sizes
from pdserve.server.generation import check_unique_rids, collect
from pdserve.server.generation import new_rid, output_stream, sampling_error, stream_interval_of, with_logprobs
from pdserve.server.http_common import ARGS_KEY, EXCHANGE_KEY, METRICS_KEY, TM_KEY, ApiError, json_response
from pdserve.server.http_common import parse_body
from pdserve.server.http_common import stream_with_early_errors
from pdserve.server.metrics import CONTENT_TYPE
from pdserve.server.schemas import AbortRequestInput, GenerateReqInput, bootstrap_for, sglang_sampling_params
from pdserve.server.tokenizer_manager import GenerateRequest, OutputDelta, TokenizerManager, merge_streams

HEALTH_GENERATE_TIMEOUT_SECONDS = 60.0
LOAD_KEYS = ("queued_prefill_tokens", "prefill_tokens_per_s", "local_prefill_tokens_per_s", "local_prefill_burst_s",
             "extend_fixed_ms", "extend_us_per_token", "decode_step_ms", "num_running_reqs", "kv_usage",
             "tpot_budget_ms", "num_waiting", "num_running")


async def generate(request: web.Request) -> web.StreamResponse:
    tm, args = request.app[TM_KEY], request.app[ARGS_KEY]
    body = await parse_body(request, GenerateReqInput)
    requests, is_batch = await build_generate_requests(args, tm, body)
    check_unique_rids(tm, requests)
    streams = [output_stream(tm, r, body.stream, request[EXCHANGE_KEY]) for r in requests]
    with_text = body.return_text_in_logprobs
    if body.stream:
        return await stream_with_early_errors(request, _generate_events(streams, requests, is_batch, with_text))
    generations = await collect(streams)
    results = [generate_result(g, r, with_text) for g, r in zip(generations, requests)]
    return json_response(results if is_batch else results[0])


async def _generate_events(
    streams: list[AsyncIterator[OutputDelta]], requests: list[GenerateRequest], is_batch: bool, with_text: bool
) -> AsyncIterator[dict]:
    generations = [Generation() for _ in streams]
    async with aclosing(merge_streams(streams)) as merged:
        async for index, delta in merged:
            generations[index].add(delta)
            event = generate_result(generations[index], requests[index], with_text)
            if is_batch:
                event["index"] = index
            yield event


async def build_generate_requests(
    args: Any, tm: TokenizerManager, body: GenerateReqInput
) -> tuple[list[GenerateRequest], bool]:
    """Sizes are checked before any tokenization, which runs off the event loop."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids")
    feature = body.unsupported_feature()
    if feature is not None:
        raise ApiError(400, f"{feature} is not supported by this server")
    size = body.batch_size
    is_batch = size is not None
    prompts: list = (body.text if body.text is not None else body.input_ids) if is_batch else [body.text or body.input_ids]
    if is_batch:
        check_batch_size(args, size)
    rids = _per_item(body.rid, len(prompts), "rid")
    nested = _per_item(body.sampling_params, len(prompts), "sampling_params")
    check_prompt_sizes(tm, prompts)
    all_input_ids = await tm.encode_prompts([[] if prompt is None else prompt for prompt in prompts])
    requests = []
    for index, input_ids in enumerate(all_input_ids):
        try:
            params = sglang_sampling_params(body, nested[index])
            host, port, room = bootstrap_for(body, index)
        except (SamplingParamsError, TypeError) as exc:
            raise sampling_error(exc) from exc
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        req = GenerateRequest(rids[index] or new_rid(), input_ids, params, bootstrap_host=host,
                              bootstrap_port=port, bootstrap_room=room, routing_key=prompts[index],
                              stream_interval=stream_interval_of(body, nested[index]))
        with_logprobs(req, bool(body.return_logprob), body.top_logprobs_num or 0,
                      -1 if body.logprob_start_len is None else body.logprob_start_len)
        settle_bootstrap(tm.args, req)  # the role it serves now (a role switch changes it)
        requests.append(req)
    await tm.check_requests(requests)
    return requests, is_batch


def _per_item(value: Any, size: int, name: str) -> list:
    if value is None:
        return [None] * size
    if not isinstance(value, list):
        return [value] * size
    if len(value) != size:
        raise ApiError(400, f"{name} must have one entry per prompt ({size}), got {len(value)}")
    return value


def generate_result(generation: Generation, request: GenerateRequest, with_text: bool) -> dict:
    last = generation.last
    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": generation.finish_reason,
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "cached_tokens": last.out.cached_tokens if last else 0,
        "e2e_latency": last.e2e_latency if last else 0.0,
        "ttft": last.ttft if last else None,
        **request.meta_note,
    }
    if request.sampling_params.wants_logprobs:
        strip = (lambda entries: entries) if with_text else _without_text
        meta["output_token_logprobs"] = strip(generation.output_logprobs)
        meta["output_top_logprobs"] = [strip(e) for e in generation.output_top_logprobs]
        meta["input_token_logprobs"] = strip(generation.input_logprobs or [])
        meta["input_top_logprobs"] = [None if e is None else strip(e) for e in generation.input_top_logprobs or []]
    return {"text": generation.text, "output_ids": generation.output_ids, "meta_info": meta}


def _without_text(entries: list) -> list:
    return [[e[0], e[1], None] for e in entries]


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    tm, args = request.app[TM_KEY], request.app[ARGS_KEY]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    probe = GenerateRequest(f"health-{new_rid()}", tm.tokenize("Hello"), params)
    if args.is_pd:
        probe.bootstrap_host, probe.bootstrap_room = FAKE_BOOTSTRAP_HOST, 0
    try:
        generations = await asyncio.wait_for(collect([tm.generate(probe)]), HEALTH_GENERATE_TIMEOUT_SECONDS)
    except TimeoutError as exc:
        raise ApiError(503, "the engine did not produce a token in time") from exc
    if not generations[0].output_ids:
        raise ApiError(503, f"the engine produced no token: {generations[0].finish_reason}")
    return web.Response(text="")


async def get_model_info(request: web.Request) -> web.Response:
    tm, args = request.app[TM_KEY], request.app[ARGS_KEY]
    info = {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path or args.model_path,
            "served_model_name": args.model_name, "is_generation": True, **tm.model_info}
    return json_response(info)


async def get_server_info(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    server_args = {k: v for k, v in dataclasses.asdict(tm.args).items()
                   if k not in ("api_key", "disaggregation_secret", "ipc_dir")}
    stats = await _scheduler_stats(tm)
    return json_response({**server_args, "model_info": tm.model_info, "scheduler": stats,
                              "requests_in_flight": len(tm.states), "time": time.time()})


async def load(request: web.Request) -> web.Response:
    """What the router's conditional disaggregation weighs (`Scheduler.load_report`): the prompt tokens queued, the
    measured prefill rate at full speed and the rate a new prompt gets now, the decode pace and KV use; and the role
    it serves now (the router's --balance-roles reads it)."""
    tm = request.app[TM_KEY]
    stats = await _scheduler_stats(tm)
    return json_response({"disaggregation_mode": tm.args.disaggregation_mode,
                          **{key: stats[key] for key in LOAD_KEYS}})


async def cache_report(request: web.Request) -> web.Response:
    """The prefix blocks this instance holds per tier, for the router's cache-aware policy (`prefix_digest`)."""
    tm = request.app[TM_KEY]  # the capacities never change: the scheduler told them once, at start
    info = tm.model_info
    return json_response(tm.prefix_digest.report(info["max_total_tokens"], info["hicache_host_total_tokens"]))


async def _scheduler_stats(tm: TokenizerManager) -> dict:
    try:
        return await tm.get_stats()
    except TimeoutError as exc:
        raise ApiError(503, "the scheduler did not answer in time") from exc


async def flush_cache(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    try:
        flushed = await tm.flush_cache()
    except TimeoutError as exc:
        raise ApiError(503, "the scheduler did not answer in time") from exc
    if not flushed:
        raise ApiError(400, "cannot flush the cache while requests are running")
    return json_response({"success": True, "message": "Cache flushed."})


async def abort_request(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    body = await parse_body(request, AbortRequestInput)
    if body.abort_all:
        return json_response({"success": True, "aborted": tm.abort_all()})
    if not tm.abort(body.rid):
        raise ApiError(404, f"no request with id {body.rid!r} is in flight")
    return json_response({"success": True, "aborted": 1})


async def metrics(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    stats = await _scheduler_stats(tm)
    text = request.app[METRICS_KEY].render(stats, in_flight=len(tm.states))
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    for prefix in ("/get_", "/"):  # SGLang serves both spellings
        app.router.add_get(f"{prefix}model_info", get_model_info)
        app.router.add_get(f"{prefix}server_info", get_server_info)
    app.router.add_get("/load", load)
    app.router.add_get("/cache_report", cache_report)
    app.router.add_get("/flush_cache", flush_cache)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/metrics", metrics)
