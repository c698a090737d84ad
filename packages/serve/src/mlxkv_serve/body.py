"""Decoding a request body once, at the edge, with limits: size, nesting depth, integer digits, text.

Everything the routes and the engine see afterwards is plain JSON within these limits, so hostile
but well-formed input is a 400 here instead of a RecursionError, a ValueError from `int()` or a
`TypeError` in the tokenizer (a lone UTF-16 surrogate) deeper down.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import ClientDisconnect, Request

from mlxkv_serve.errors import ClientGone, RequestError

MAX_DEPTH = 64  # a chat request needs ~5 levels; the JSON decoder itself recurses
MAX_INT_DIGITS = 20  # 2**64 has 20 digits; no field takes more


async def read_json(request: Request, limit: int) -> Any:
    """The body of a generation request as JSON: 415 unless it is declared JSON, 413 over `limit`
    bytes, 400 when malformed or past the limits above."""
    _require_json(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestError(413, f"request body exceeds the {limit}-byte limit")
    except ClientDisconnect:
        raise ClientGone("the client closed the connection while sending the body") from None
    return decode_json(bytes(body))


def decode_json(body: bytes) -> Any:
    try:
        value = json.loads(body, parse_int=_parse_int, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    _check(value)
    return value


def _require_json(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        shown = media_type or "none"
        raise RequestError(415, f"the request body must be sent as 'Content-Type: application/json' (got {shown})")


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise RequestError(400, f"an integer in the request body has more than {MAX_INT_DIGITS} digits")
    return int(digits)


def _refuse_constant(name: str) -> Any:
    raise RequestError(400, f"the request body is not valid JSON: {name} is not a JSON number")


def _check(value: Any) -> None:
    """Depth and text checks, iteratively (no recursion on hostile input); names the first bad field."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RequestError(400, f"the request body nests deeper than {MAX_DEPTH} levels", _top(path))
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, path)
                stack.append((child, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        where = f"'{path}'" if path else "the request body"
        raise RequestError(400, f"{where} holds text that is not valid Unicode (a lone UTF-16 surrogate)", path or None) from None


def _top(path: str) -> str | None:
    return path.split(".")[0].split("[")[0] or None
