"""POST /v1/messages (Anthropic Messages API, streaming event sequence included)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlxkv_serve.anthropic_schema import parse_messages
from mlxkv_serve.body import read_json
from mlxkv_serve.engine import Delta, Failed, Finished, GenerationHandle, ToolCall
from mlxkv_serve.errors import RequestError, error_body
from mlxkv_serve.state import ServerState
from mlxkv_serve.streaming import collect, failure, for_model, guarded, served_model, sse, submit


async def messages(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    body = await read_json(request, state.config.max_body_bytes)
    parsed = parse_messages(body, state.config)
    model = served_model(state, body)
    state.metrics.billing_headers.inc(parsed.billing_headers)
    handle = await submit(state.engine, for_model(parsed.generate, model))
    headers = {"x-mlxkv-generation-id": handle.generation_id}
    if parsed.stream:
        return StreamingResponse(guarded(request, state, handle, _stream(state, model, handle)), media_type="text/event-stream", headers=headers)
    deltas, done = await collect(request, state, handle)
    text, reasoning = "".join(d.text for d in deltas), "".join(d.reasoning for d in deltas)
    blocks = ([{"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)}] if reasoning else []) \
        + ([{"type": "text", "text": text}] if text or not done.tool_calls else []) + [_tool_use(c) for c in done.tool_calls]
    return JSONResponse(_message(model, handle, blocks, done), headers=headers)


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt tokens a generation of this request would report
    (`input_tokens` plus `cache_read_input_tokens`), by the same template and tokenizer."""
    state: ServerState = request.app.state.mlxkv
    body = await read_json(request, state.config.max_body_bytes)
    parsed = parse_messages(body, state.config, counting=True)
    model = served_model(state, body)
    try:
        tokens = await state.engine.count_tokens(for_model(parsed.generate, model))
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    return JSONResponse({"input_tokens": tokens})


def _message(model: str, handle: GenerationHandle, content: list[dict[str, Any]], done: Finished | None) -> dict[str, Any]:
    return {
        "id": "msg_" + handle.generation_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": _stop_reason(done) if done else None,
        "stop_sequence": done.stop_sequence if done else None,
        "usage": _usage(handle, done),
    }


def _usage(handle: GenerationHandle, done: Finished | None) -> dict[str, int]:
    cached = done.cached_tokens if done else 0
    return {"input_tokens": handle.prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": done.completion_tokens if done else 0,
            "resumed_tokens": done.resumed_tokens if done else 0}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id, "name": call.name, "input": json.loads(call.arguments)}


def _stop_reason(done: Finished) -> str:
    if done.finish_reason == "tool_calls":
        return "tool_use"
    if done.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if done.stop_sequence else "end_turn"


async def _stream(state: ServerState, model: str, handle: GenerationHandle) -> AsyncIterator[str]:
    """Blocks open as their content comes: thinking (a reasoning model's), then text (an answer of
    calls alone has none, as unstreamed), then the tool_use blocks."""
    yield sse({"type": "message_start", "message": _message(model, handle, [], None)}, "message_start")
    yield sse({"type": "ping"}, "ping")
    blocks = _Blocks()
    async for event in handle.events():
        if isinstance(event, Delta):
            for frame in blocks.delta(event):
                yield frame
            continue
        if isinstance(event, Failed):
            yield sse(error_body("/v1/messages", failure(state, event)), "error")  # Anthropic's in-stream error
            return
        state.record(event)
        for frame in blocks.close(empty_text=not event.tool_calls):
            yield frame
        for index, call in enumerate(event.tool_calls, start=blocks.count):
            for frame in _tool_use_frames(index, call):
                yield frame
        yield sse({"type": "message_delta", "delta": {"stop_reason": _stop_reason(event), "stop_sequence": event.stop_sequence},
                   "usage": _usage(handle, event)}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")
        return


class _Blocks:
    """The open content block of a streamed message ("thinking" or "text") and how many there were."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None
        self.thinking = ""
        self.texted = False  # a text block was opened

    def delta(self, event: Delta) -> Iterator[str]:
        if event.reasoning:
            yield from self._switch("thinking")
            self.thinking += event.reasoning
            yield self._frame("content_block_delta", delta={"type": "thinking_delta", "thinking": event.reasoning})
        if event.text:
            yield from self._switch("text")
            yield self._frame("content_block_delta", delta={"type": "text_delta", "text": event.text})

    def close(self, *, empty_text: bool) -> Iterator[str]:
        """The open block's end; an empty answer without calls gets one empty text block, as unstreamed."""
        if empty_text and not self.texted:
            yield from self._switch("text")
        yield from self._switch(None)

    def _switch(self, kind: str | None) -> Iterator[str]:
        if self.open == kind:
            return
        if self.open == "thinking":
            yield self._frame("content_block_delta", delta={"type": "signature_delta", "signature": signature(self.thinking)})
        if self.open is not None:
            yield self._frame("content_block_stop")
            self.count += 1
        self.open = kind
        self.texted = self.texted or kind == "text"
        if kind is not None:
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
            yield self._frame("content_block_start", content_block=block)

    def _frame(self, kind: str, **fields: Any) -> str:
        return sse({"type": kind, "index": self.count, **fields}, kind)


def signature(thinking: str) -> str:
    """A thinking block's `signature`: opaque to clients, who send it back; mlxkv does not check it
    (a client's edited thinking only changes its own prompt)."""
    return "mlxkv-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _tool_use_frames(index: int, call: ToolCall) -> Iterator[str]:
    """One tool_use block: its start, its input as one `input_json_delta`, its stop."""
    start = {**_tool_use(call), "input": {}}
    yield sse({"type": "content_block_start", "index": index, "content_block": start}, "content_block_start")
    yield sse({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
              "content_block_delta")
    yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
