"""The Starlette application: routes, auth, body limit, metrics, and the one error mapping."""

from __future__ import annotations

import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxkv_serve import admin_routes, anthropic_routes, openai_routes
from mlxkv_serve.config import ServeConfig
from mlxkv_serve.engine import ServeEngine
from mlxkv_serve.errors import RequestError, error_response
from mlxkv_serve.metrics import ServerMetrics
from mlxkv_serve.state import ServerState

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health",)

ROUTES = [
    Route("/v1/chat/completions", openai_routes.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai_routes.completions, methods=["POST"]),
    Route("/v1/models", openai_routes.models, methods=["GET"]),
    Route("/v1/messages", anthropic_routes.messages, methods=["POST"]),
    Route("/health", admin_routes.health, methods=["GET"]),
    Route("/metrics", admin_routes.metrics, methods=["GET"]),
    Route("/v1/cache/stats", admin_routes.cache_stats, methods=["GET"]),
    Route("/admin/cache/flush", admin_routes.cache_flush, methods=["POST"]),
    Route("/v1/generations/{generation_id}", admin_routes.generation, methods=["GET"]),
]
KNOWN_PATHS = {r.path for r in ROUTES}


def build_app(engine: ServeEngine, config: ServeConfig) -> Starlette:
    state = ServerState(engine, config, ServerMetrics(engine.cache_stats))
    app = Starlette(
        routes=ROUTES,
        exception_handlers={RequestError: _request_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.mlxkv = state
    app.add_middleware(_Gate, state=state)
    return app


class _Gate:
    """API-key check (every path but /health) and request counting by endpoint and status."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in KNOWN_PATHS else ("/v1/generations/{id}" if path.startswith("/v1/generations/") else "other")
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.state.config.api_key and path not in OPEN_PATHS and not _authorized(scope, self.state.config.api_key):
                response = error_response(Request(scope), RequestError(401, "invalid or missing API key"))
                await response(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.requests.labels(endpoint, str(status["code"])).inc()


def _authorized(scope: Scope, key: str) -> bool:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    offered = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ").strip()
    return hmac.compare_digest(offered.encode(), key.encode())


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return error_response(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route for {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return error_response(request, RequestError(exc.status_code, message.get(exc.status_code, str(exc.detail))))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s", request.url.path)
    return error_response(request, RequestError(500, "internal server error"))
