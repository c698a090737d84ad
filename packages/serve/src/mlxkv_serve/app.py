"""The Starlette application: routes, host and key checks, metrics, and the one error mapping."""

from __future__ import annotations

import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxkv_serve import adapter_routes, admin_routes, anthropic_routes, cache_routes, openai_routes, responses_routes
from mlxkv_serve.config import LOCAL_ORIGINS, ServeConfig
from mlxkv_serve.engine import MemoryReporting, ServeEngine
from mlxkv_serve.errors import ClientGone, RequestError, error_response
from mlxkv_serve.metrics import ServerMetrics
from mlxkv_serve.responses_store import MemoryResponseStore, ResponseStore
from mlxkv_serve.state import ServerState

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health",)
CLIENT_CLOSED = 499  # nginx's status for a request the client abandoned (never sent)

ROUTES = [
    Route("/v1/chat/completions", openai_routes.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai_routes.completions, methods=["POST"]),
    Route("/v1/models", openai_routes.models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", openai_routes.model, methods=["GET"]),
    Route("/v1/messages", anthropic_routes.messages, methods=["POST"]),
    Route("/v1/responses", responses_routes.create, methods=["POST"]),
    Route("/v1/responses/{response_id}", responses_routes.retrieve, methods=["GET"]),
    Route("/v1/responses/{response_id}", responses_routes.delete, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", responses_routes.list_input_items, methods=["GET"]),
    Route("/v1/messages/count_tokens", anthropic_routes.count_tokens, methods=["POST"]),
    Route("/v1/adapters", adapter_routes.add, methods=["POST"]),
    Route("/v1/adapters/{name}", adapter_routes.remove, methods=["DELETE"]),
    Route("/health", admin_routes.health, methods=["GET"]),
    Route("/metrics", admin_routes.metrics, methods=["GET"]),
    Route("/v1/cache/stats", admin_routes.cache_stats, methods=["GET"]),
    Route("/v1/cache/lookup", cache_routes.lookup, methods=["POST"]),
    Route("/admin/cache/flush", admin_routes.cache_flush, methods=["POST"]),
    Route("/v1/generations/{generation_id}", admin_routes.generation, methods=["GET"]),
]
KNOWN_PATHS = {r.path for r in ROUTES if "{" not in r.path}
# A path with a parameter is counted under its route's prefix: "/v1/models/{id}", not each id.
TEMPLATED_PREFIXES = [r.path[: r.path.index("{")] for r in ROUTES if "{" in r.path]


def build_app(engine: ServeEngine, config: ServeConfig, responses: ResponseStore | None = None) -> Starlette:
    """`responses`: where `store: true` responses are kept (default: in memory)."""
    state = ServerState(engine, config, ServerMetrics(engine.cache_stats, engine.queue_depth, engine.batch_size,
                                                      engine.memory if isinstance(engine, MemoryReporting) else None))
    app = Starlette(
        routes=ROUTES,
        exception_handlers={RequestError: _request_error, ClientGone: _client_gone, HTTPException: _http_error,
                            Exception: _internal_error},
    )
    app.state.mlxkv = state
    app.state.responses = responses if responses is not None else MemoryResponseStore()
    app.add_middleware(_Gate, state=state)
    # Outermost: a browser's preflight carries no API key, and refusals need the CORS headers too.
    app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_origin_regex=LOCAL_ORIGINS,
                       allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"],
                       expose_headers=["x-mlxkv-generation-id", "retry-after", responses_routes.LEFT_OUT_HEADER])
    return app


def endpoint_label(path: str) -> str:
    if path in KNOWN_PATHS:
        return path
    return next((prefix + "{id}" for prefix in TEMPLATED_PREFIXES if path.startswith(prefix)), "other")


class _Gate:
    """Host and API-key checks (every path but /health needs the key) and request counting by endpoint and status."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await error_response(Request(scope), refusal)(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.requests.labels(endpoint_label(scope["path"]), str(status["code"])).inc()

    def _refusal(self, scope: Scope) -> RequestError | None:
        config = self.state.config
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if config.allowed_hosts is not None and _host_name(headers.get("host", "")) not in config.allowed_hosts:
            return RequestError(403, f"this server answers only to Host {', '.join(sorted(config.allowed_hosts))} "
                                "(a loopback server refuses other names: DNS rebinding)")
        if config.api_key and scope["path"] not in OPEN_PATHS and not _authorized(headers, config.api_key):
            return RequestError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')")
        return None


def _host_name(host: str) -> str:
    """The Host header without its port: 'localhost:8080' -> 'localhost', '[::1]:80' -> '[::1]'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _authorized(headers: dict[str, str], key: str) -> bool:
    offered = headers.get("x-api-key")
    if offered is None:
        scheme, _, credentials = headers.get("authorization", "").strip().partition(" ")
        offered = credentials.strip() if scheme.lower() == "bearer" else ""
    return hmac.compare_digest(offered.encode(), key.encode())


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    if exc.status >= 500:
        log.error("%s on %s: %s", exc.status, request.url.path, exc.message)
    return error_response(request, exc)


async def _client_gone(request: Request, exc: Exception) -> Response:
    state: ServerState = request.app.state.mlxkv
    state.metrics.disconnects.labels(endpoint_label(request.url.path)).inc()
    log.info("%s %s: %s", request.method, request.url.path, exc)
    return Response(status_code=CLIENT_CLOSED)  # the client is gone: nothing reaches it


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route for {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return error_response(request, RequestError(exc.status_code, message.get(exc.status_code, str(exc.detail))))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s", request.url.path)
    return error_response(request, RequestError(500, "internal server error"))
