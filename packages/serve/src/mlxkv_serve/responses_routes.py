"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}, GET its input_items (OpenAI
Responses API)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlxkv_serve.body import read_json
from mlxkv_serve.errors import RequestError
from mlxkv_serve.responses_input_items import input_item_page
from mlxkv_serve.responses_items import Item, item
from mlxkv_serve.responses_schema import ResponsesRequest, parse_responses, previous_id
from mlxkv_serve.responses_store import ResponseStore, StoredResponse
from mlxkv_serve.responses_stream import ResponseBuilder, ResponseIds, stream
from mlxkv_serve.state import ServerState
from mlxkv_serve.streaming import collect, for_model, guarded, served_model, submit

log = logging.getLogger(__name__)
LEFT_OUT_HEADER = "x-mlxkv-tools-left-out"


async def create(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    store: ResponseStore = request.app.state.responses
    body = await read_json(request, state.config.max_body_bytes)
    previous = previous_id(body)
    model = served_model(state, body)
    history = await _history(store, previous, model) if previous else ()
    parsed = parse_responses(body, state.config, history)
    headers = {}
    if parsed.tools.left_out:
        # NOTE: hosted tools (web search, code interpreter, ...) run on OpenAI's side; offering them to
        # a local model would invite calls nobody answers.
        headers[LEFT_OUT_HEADER] = ",".join(parsed.tools.left_out)
        log.info("/v1/responses: left out tools this server cannot run: %s", ", ".join(parsed.tools.left_out))
    handle = await submit(state.engine, for_model(parsed.generate, model))
    headers["x-mlxkv-generation-id"] = handle.generation_id
    ids = ResponseIds("resp_" + uuid.uuid4().hex, int(time.time()), model, previous, parsed.store)
    builder = ResponseBuilder(ids, parsed.echo, parsed.tools)
    conversation = (*history, *parsed.items)
    if parsed.stream:
        frames = _stream_then_store(state, store, handle_stream=stream(state, handle, builder), builder=builder,
                                    parsed=parsed, conversation=conversation)
        return StreamingResponse(guarded(request, state, handle, frames), media_type="text/event-stream", headers=headers)
    deltas, done = await collect(request, state, handle)
    for delta in deltas:
        builder.delta(delta)
    builder.finish(done)
    await _keep(store, builder, parsed, conversation)
    return JSONResponse(builder.response(), headers=headers)


async def retrieve(request: Request) -> Response:
    found = await _found(request)
    return JSONResponse(found.response)


async def list_input_items(request: Request) -> Response:
    found = await _found(request)
    return JSONResponse(input_item_page(found, request.query_params))


async def delete(request: Request) -> Response:
    store: ResponseStore = request.app.state.responses
    response_id = request.path_params["response_id"]
    if not await asyncio.to_thread(store.delete, response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def _found(request: Request) -> StoredResponse:
    store: ResponseStore = request.app.state.responses
    response_id = request.path_params["response_id"]
    found = await asyncio.to_thread(store.get, response_id)
    if found is None:
        raise _not_found(response_id)
    return found


async def _history(store: ResponseStore, response_id: str, model: str) -> tuple[Item, ...]:
    """The conversation a continuation builds on; its items are checked again (a file edited by hand
    is a miss, not a 500)."""
    found = await asyncio.to_thread(store.get, response_id)
    if found is None:
        raise _not_found(response_id, "previous_response_id")
    if found.model != model:
        raise RequestError(400, f"previous response '{response_id}' was made by model '{found.model}'; this server serves "
                           f"'{model}'", "previous_response_id")
    try:
        return tuple(item(entry, "stored item") for entry in found.items)
    except RequestError:
        log.warning("stored response %s holds an unreadable item; treated as missing", response_id)
        raise _not_found(response_id, "previous_response_id") from None


def _not_found(response_id: str, param: str | None = None) -> RequestError:
    return RequestError(404, f"Response with id '{response_id}' not found.", param, "response_not_found")


async def _stream_then_store(state: ServerState, store: ResponseStore, *, handle_stream: AsyncIterator[str],
                             builder: ResponseBuilder, parsed: ResponsesRequest, conversation: Sequence[Item]) -> AsyncIterator[str]:
    async for frame in handle_stream:
        yield frame
    await _keep(store, builder, parsed, conversation)


async def _keep(store: ResponseStore, builder: ResponseBuilder, parsed: ResponsesRequest, conversation: Sequence[Item]) -> None:
    """Store a finished response (`store: true`): its conversation and output, to continue from."""
    if not parsed.store or builder.status not in ("completed", "incomplete"):
        return
    output: list[dict[str, Any]] = builder.output
    items = (*conversation, *(item(entry, "output") for entry in output))
    stored = StoredResponse(builder.ids.response_id, builder.ids.model, items, builder.response())
    await asyncio.to_thread(store.put, stored)
