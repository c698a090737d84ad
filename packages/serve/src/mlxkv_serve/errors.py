"""Request errors and their two JSON shapes (OpenAI's and Anthropic's), mapped in one place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class RequestError(Exception):
    """A client mistake (4xx), a refusal (429, 503) or a failure (500), with the offending parameter when known."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


class ClientGone(Exception):
    """The client went away before its request was read or answered: nothing can be sent back."""


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, error: RequestError) -> dict[str, Any]:
    if is_anthropic(path):
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(error.status, "invalid_request_error"),
                                           "message": error.message}}
    return {"error": {"message": error.message, "type": _OPENAI_TYPES.get(error.status, "invalid_request_error"),
                      "param": error.param, "code": error.code}}


def error_response(request: Request, error: RequestError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
    return JSONResponse(error_body(request.url.path, error), status_code=error.status, headers={**headers, **error.headers})
