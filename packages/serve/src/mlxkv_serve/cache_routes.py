"""POST /v1/cache/lookup: how much of a prompt this replica holds, from its indexes alone.

For a router that sends a conversation where its prefix is hot: it asks each replica about the
request it is about to route (the body of a chat or a completions request, as is) and picks the
one holding the most. Nothing is read or restored, and nothing changes (recency included). On a
server with several models the request's `model` picks the one asked (its answer says which, and
its `state`); a model not loaded answers `prompt_tokens` null and 0 cached tokens.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxkv_serve.body import read_json
from mlxkv_serve.engine import PrefixLookup, UnknownModelError
from mlxkv_serve.errors import RequestError
from mlxkv_serve.openai_schema import parse_chat, parse_completion
from mlxkv_serve.state import ServerState


async def lookup(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    engine = state.engine
    if not isinstance(engine, PrefixLookup):
        raise RequestError(404, "this server keeps no prompt cache to look a prompt up in", code="not_found")
    body: Any = await read_json(request, state.config.max_body_bytes)
    chat = isinstance(body, dict) and "messages" in body
    parsed = parse_chat(body, state.config) if chat else parse_completion(body, state.config)
    try:
        found = await engine.cached_prefix(parsed.generate)
    except UnknownModelError as e:
        raise RequestError(404, str(e), e.param, "model_not_found") from None
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    answer = {"model": found.model or engine.model_id, "prompt_tokens": found.prompt_tokens,
              "cached_tokens": found.cached_tokens, "tier": found.tier}
    return JSONResponse(answer if found.state is None else {**answer, "state": found.state})
