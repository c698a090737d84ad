"""Request errors and their two JSON shapes (OpenAI's and Anthropic's), mapped in one place."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class RequestError(Exception):
    """A client mistake (4xx) or a refusal (503), with the offending parameter when known."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_response(request: Request, error: RequestError) -> JSONResponse:
    if request.url.path.startswith("/v1/messages"):
        body: dict[str, object] = {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(error.status, "invalid_request_error"), "message": error.message},
        }
    else:
        body = {"error": {"message": error.message, "type": _OPENAI_TYPES.get(error.status, "invalid_request_error"),
                          "param": error.param, "code": error.code}}
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(body, status_code=error.status, headers=headers)
