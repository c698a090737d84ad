"""Reading request bodies, collecting or streaming engine events, SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from mlxkv_serve.engine import Delta, Finished, GenerationHandle, GenerateRequest, PromptTooLongError, ServeEngine
from mlxkv_serve.errors import RequestError

DISCONNECT_POLL_S = 0.5


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(413, f"request body exceeds the {limit}-byte limit")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None


def submit(engine: ServeEngine, request: GenerateRequest) -> GenerationHandle:
    try:
        return engine.submit(request)
    except PromptTooLongError as e:
        raise RequestError(400, str(e), "messages" if request.messages is not None else "prompt", "context_length_exceeded") from None
    except ValueError as e:
        raise RequestError(400, str(e)) from None


async def collect(request: Request, handle: GenerationHandle) -> tuple[list[Delta], Finished]:
    """All events of a non-streaming generation; a client that goes away cancels it."""
    drain = asyncio.ensure_future(_drain(handle))
    while not drain.done():
        await asyncio.wait({drain}, timeout=DISCONNECT_POLL_S)  # never cancels the drain
        if not drain.done() and await request.is_disconnected():
            handle.cancel()
            drain.cancel()
            raise RequestError(499, "client closed the request")
    return drain.result()


async def _drain(handle: GenerationHandle) -> tuple[list[Delta], Finished]:
    deltas: list[Delta] = []
    async for event in handle.events():
        if isinstance(event, Finished):
            return deltas, event
        deltas.append(event)
    raise RuntimeError("the generation ended without a Finished event")


async def guarded(handle: GenerationHandle, frames: AsyncIterator[str]) -> AsyncIterator[str]:
    """Stream `frames`; when the client disconnects (the task is cancelled), cancel the generation."""
    try:
        async for frame in frames:
            yield frame
    finally:
        handle.cancel()


def sse(data: Any, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"
