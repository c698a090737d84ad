"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models (OpenAI shapes)."""

from __future__ import annotations

import codecs
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlxkv_serve.body import read_json
from mlxkv_serve.engine import AdapterServing, Delta, Failed, Finished, GenerationHandle, ModelCatalog, ModelInfo, TokenLogprob
from mlxkv_serve.errors import RequestError, error_body
from mlxkv_serve.openai_schema import OpenAiRequest, parse_chat, parse_completion
from mlxkv_serve.state import ServerState
from mlxkv_serve.streaming import collect, failure, for_model, guarded, served_model, sse, submit


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def models(request: Request) -> Response:
    """The served model and its adapters, or, on a server with several, each model with its state (loaded or not)."""
    state: ServerState = request.app.state.mlxkv
    if isinstance(state.engine, ModelCatalog):
        return JSONResponse({"object": "list", "data": _catalog(state, state.engine)})
    return JSONResponse({"object": "list", "data": [_model(state, name) for name in _served_ids(state)]})


async def model(request: Request) -> Response:
    """The served model by its id (the OpenAI client's `models.retrieve`); any other id is a 404."""
    state: ServerState = request.app.state.mlxkv
    asked = request.path_params["model_id"]
    if isinstance(state.engine, ModelCatalog):
        found = [listed for listed in _catalog(state, state.engine) if listed["id"] == asked]
        if not found:
            raise RequestError(404, f"the model '{asked}' does not exist; this server serves "
                               f"{', '.join(repr(i.name) for i in state.engine.models())}", "model", "model_not_found")
        return JSONResponse(found[0])
    if asked not in _served_ids(state):
        raise RequestError(404, f"the model '{asked}' does not exist; this server serves '{state.engine.model_id}'",
                           "model", "model_not_found")
    return JSONResponse(_model(state, asked))


def _served_ids(state: ServerState) -> list[str]:
    """The model, then each adapter as `<model id>:NAME` (a request may name it so, or by NAME)."""
    engine = state.engine
    names = engine.adapter_names() if isinstance(engine, AdapterServing) else ()
    return [engine.model_id, *(f"{engine.model_id}:{name}" for name in names)]


def _model(state: ServerState, model_id: str) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": state.started, "owned_by": "mlxkv"}


def _catalog(state: ServerState, catalog: ModelCatalog) -> list[dict[str, object]]:
    """Each model with its state, then each of its adapters as `<name>:ADAPTER` (in its model's state)."""
    return [entry for info in catalog.models()
            for entry in (_listed(state, info), *(_listed(state, info, f"{info.name}:{a}") for a in info.adapters))]


def _listed(state: ServerState, info: ModelInfo, model_id: str | None = None) -> dict[str, object]:
    listed: dict[str, object] = {"id": model_id or info.name, "object": "model", "created": state.started, "owned_by": "mlxkv",
                                 "state": info.state, "pinned": info.pinned}
    if info.error is not None:
        listed["error"] = info.error
    return listed


async def _complete(request: Request, *, chat: bool) -> Response:
    state: ServerState = request.app.state.mlxkv
    body = await read_json(request, state.config.max_body_bytes)
    parsed = (parse_chat if chat else parse_completion)(body, state.config)
    model = served_model(state, body)
    handle = await submit(state.engine, for_model(parsed.generate, model))
    headers = {"x-mlxkv-generation-id": handle.generation_id}
    ids = _Ids(("chatcmpl-" if chat else "cmpl-") + handle.generation_id, int(time.time()), model, chat)
    if parsed.stream:
        frames = guarded(request, state, handle, _stream(state, handle, parsed, ids))
        return StreamingResponse(frames, media_type="text/event-stream", headers=headers)
    deltas, done = await collect(request, state, handle)
    text = "".join(d.text for d in deltas)
    logprobs = [lp for d in deltas for lp in d.logprobs]
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text or None if done.tool_calls else text}
        reasoning = "".join(d.reasoning for d in deltas)
        if reasoning:
            choice["message"]["reasoning_content"] = reasoning
        if done.tool_calls:
            choice["message"]["tool_calls"] = _tool_calls(done)
        choice["logprobs"] = _chat_logprobs(logprobs) if parsed.generate.top_logprobs is not None else None
    else:
        choice["text"] = text
        choice["logprobs"] = _completion_logprobs(logprobs, 0) if parsed.generate.top_logprobs is not None else None
    return JSONResponse({**ids.envelope(), "choices": [choice], "usage": _usage(done), "seed": done.seed}, headers=headers)


class _Ids:
    def __init__(self, response_id: str, created: int, model: str, chat: bool) -> None:
        self.response_id, self.created, self.model, self.chat = response_id, created, model, chat

    def envelope(self, chunk: bool = False) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.response_id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "mlxkv"}


async def _stream(state: ServerState, handle: GenerationHandle, parsed: OpenAiRequest, ids: _Ids) -> AsyncIterator[str]:
    want_logprobs = parsed.generate.top_logprobs is not None
    # With include_usage, every chunk before the last carries "usage": null, as OpenAI's do.
    head = {**ids.envelope(True), **({"usage": None} if parsed.include_usage else {})}
    if ids.chat:
        yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]})
    offset = 0
    async for event in handle.events():
        if isinstance(event, Delta):
            if not event.text and not event.reasoning and not event.logprobs:
                continue
            yield sse({**head, "choices": [_chunk_choice(ids.chat, event, want_logprobs, offset)]})
            offset += len(event.text)
            continue
        if isinstance(event, Failed):
            yield sse(error_body("/v1", failure(state, event)))  # OpenAI's in-stream error: no [DONE] follows
            return
        state.record(event)
        if event.tool_calls:  # each call in one chunk: its arguments are complete when the answer is
            calls = [{"index": i, **call} for i, call in enumerate(_tool_calls(event))]
            yield sse({**head, "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None,
                                                          "logprobs": None}]})
        final: dict[str, Any] = {"index": 0, "finish_reason": event.finish_reason, "logprobs": None}
        if ids.chat:
            final["delta"] = {}
        else:
            final["text"] = ""
        yield sse({**head, "choices": [final], "seed": event.seed})
        if parsed.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(event)})
        yield sse("[DONE]")
        return


def _chunk_choice(chat: bool, delta: Delta, want_logprobs: bool, offset: int) -> dict[str, Any]:
    if chat:
        # A reasoning model's thinking goes in `reasoning_content` (as vLLM and DeepSeek send it).
        content = {"reasoning_content": delta.reasoning} if delta.reasoning else {}
        if delta.text or not delta.reasoning:
            content["content"] = delta.text
        return {"index": 0, "delta": content, "finish_reason": None,
                "logprobs": _chat_logprobs(list(delta.logprobs)) if want_logprobs else None}
    return {"index": 0, "text": delta.text, "finish_reason": None,
            "logprobs": _completion_logprobs(list(delta.logprobs), offset) if want_logprobs else None}


def _tool_calls(done: Finished) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in done.tool_calls]


def _usage(done: Finished) -> dict[str, Any]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
            "resumed_tokens": done.resumed_tokens}


def _chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.bytes),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, v, b in lp.top]} for lp in items]}


def _completion_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """`text_offset`: where each token starts in the text, `offset` characters in (a token that
    continues a character starts where that character does)."""
    offsets, decoder = [], codecs.getincrementaldecoder("utf-8")("ignore")  # holds a character's first bytes
    for lp in items:
        offsets.append(offset)
        offset += len(decoder.decode(bytes(lp.bytes)))
    return {"tokens": [lp.token for lp in items], "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{t: v for t, v, _ in lp.top} for lp in items], "text_offset": offsets}
