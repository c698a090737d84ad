"""Submitting generations, collecting or streaming their events, SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from mlxkv_serve.engine import (
    Delta, Failed, Finished, GenerateRequest, GenerationHandle, ModelCatalog, ModelUnavailableError, PromptTooLongError, QueueFullError,
    ServeEngine, UnknownModelError,
)
from mlxkv_serve.errors import ClientGone, RequestError
from mlxkv_serve.state import ServerState

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5


def served_model(state: ServerState, body: Any) -> str:
    """The name of the model that serves a request whose body is `body` (its `model`, on a server
    with several; the one model, whatever the name, on a server with one)."""
    engine = state.engine
    if not isinstance(engine, ModelCatalog):
        return engine.model_id
    asked = body.get("model") if isinstance(body, dict) else None
    try:
        return engine.resolve(asked if isinstance(asked, str) else None)
    except UnknownModelError as e:
        raise RequestError(404, str(e), "model", "model_not_found") from None


def for_model(request: GenerateRequest, model: str) -> GenerateRequest:
    """`request` for the model `served_model` chose; a `model` the request gave is kept, since it
    may also name adapters (`NAME`, `<model id>:NAME`) that the chosen model's engine selects."""
    return request if request.model else replace(request, model=model)


async def submit(engine: ServeEngine, request: GenerateRequest) -> GenerationHandle:
    try:
        return await engine.submit(request)
    except UnknownModelError as e:
        raise RequestError(404, str(e), e.param, "model_not_found") from None
    except ModelUnavailableError as e:
        headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else {}
        raise RequestError(503, str(e), "model", "model_unavailable", headers=headers) from None
    except PromptTooLongError as e:
        raise RequestError(400, str(e), "messages" if request.messages is not None else "prompt", "context_length_exceeded") from None
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    except QueueFullError as e:
        raise RequestError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after_s)}) from None


async def collect(request: Request, state: ServerState, handle: GenerationHandle) -> tuple[list[Delta], Finished]:
    """All events of a non-streaming generation; a client that goes away cancels it, a failure is a 500."""
    drain = asyncio.ensure_future(_drain(handle))
    while not drain.done():
        await asyncio.wait({drain}, timeout=DISCONNECT_POLL_S)  # never cancels the drain
        if not drain.done() and await request.is_disconnected():
            handle.cancel()
            drain.cancel()
            raise ClientGone(f"the client left before generation {handle.generation_id} finished; cancelled")
    deltas, done = drain.result()
    if isinstance(done, Failed):
        raise failure(state, done)
    state.record(done)
    return deltas, done


def failure(state: ServerState, failed: Failed) -> RequestError:
    """A failed generation as the 500 the client gets (the engine logged the traceback)."""
    state.metrics.failures.inc()
    return RequestError(500, f"generation {failed.generation_id} failed: {failed.message}", code="generation_failed",
                        headers={"x-mlxkv-generation-id": failed.generation_id})


async def _drain(handle: GenerationHandle) -> tuple[list[Delta], Finished | Failed]:
    deltas: list[Delta] = []
    async for event in handle.events():
        if not isinstance(event, Delta):
            return deltas, event
        deltas.append(event)
    raise RuntimeError("the generation ended without a Finished or Failed event")


async def guarded(request: Request, state: ServerState, handle: GenerationHandle, frames: AsyncIterator[str]) -> AsyncIterator[str]:
    """Stream `frames`; when the client disconnects (the task is cancelled), cancel the generation and count it."""
    complete = False
    try:
        async for frame in frames:
            yield frame
        complete = True
    finally:
        handle.cancel()
        if not complete:
            state.metrics.disconnects.labels(request.url.path).inc()
            log.info("the client left the stream of generation %s; cancelled", handle.generation_id)


def sse(data: Any, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"
