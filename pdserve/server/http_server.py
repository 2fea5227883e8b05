"""The HTTP server's app factory: middlewares, shared state, and the native and OpenAI routes.

Both route modules talk to the engine only through the tokenizer manager and share `http_common.py`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pdserve.cluster_auth import make_auth
from pdserve.server import native_api, openai_api, role_switch_api
from pdserve.server.drain import Drain
from pdserve.server.http_common import (ARGS_KEY, METRICS_KEY, TM_KEY, auth_middleware, error_middleware,
                                        body_timeout_middleware, mark_answer_started, router_auth_middleware,
                                        timeline_middleware)
from pdserve.server.metrics import ServerMetrics
from pdserve.server.tokenizer_manager import TokenizerManager

MAX_BODY_BYTES = 64 * 1024 * 1024
DRAIN_KEY = web.AppKey("drain", Drain)


def create_app(args: Any, tm: TokenizerManager, server_metrics: ServerMetrics) -> web.Application:
    drain = Drain()
    middlewares = [timeline_middleware, error_middleware, drain.middleware,
                   body_timeout_middleware(args.request_body_timeout_s)]
    middlewares += [auth_middleware(args.api_key)] if args.api_key else []
    cluster = make_auth(args.disaggregation_secret, args.api_key) if args.is_pd else None
    if cluster is not None:
        middlewares.append(router_auth_middleware(cluster))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[TM_KEY], app[ARGS_KEY], app[METRICS_KEY], app[DRAIN_KEY] = tm, args, server_metrics, drain
    app.on_response_prepare.append(mark_answer_started)
    native_api.add_routes(app)
    openai_api.add_routes(app)
    role_switch_api.add_routes(app, role_switch_api.RoleSwitcher(tm, drain))
    return app
