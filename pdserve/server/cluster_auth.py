"""A PD server with a cluster secret takes generation requests (and so bootstrap fields) only from the router:
each needs the router's `X-PD-Auth` token over its method, path and body (see pdserve.disagg.auth)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pdserve.disagg.auth import HEADER, AuthError, ClusterAuth
from pdserve.server.http_common import ApiError

GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})


def router_auth_middleware(auth: ClusterAuth) -> Any:
    @web.middleware
    async def check_router_token(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST" and request.path in GENERATION_PATHS:
            try:
                auth.verify_token(request.headers.get(HEADER), "POST", request.path_qs, await request.read())
            except AuthError as exc:
                raise ApiError(401, f"PD requests are accepted only from the router ({exc})",
                               "invalid_cluster_auth") from None
        return await handler(request)

    return check_router_token
