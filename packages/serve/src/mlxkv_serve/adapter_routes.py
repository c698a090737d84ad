"""POST /v1/adapters (name + path, under the operator's --adapter-dir only; `model` picks one of
several models) and DELETE /v1/adapters/{id} (`NAME`, or `MODEL:NAME` as POST answered it)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxkv_serve.body import read_json
from mlxkv_serve.engine import AdapterManaging, ModelUnavailableError, ServeEngine, UnknownModelError
from mlxkv_serve.errors import RequestError
from mlxkv_serve.fields import Fields
from mlxkv_serve.state import ServerState


async def add(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    engine = _managing(state.engine)
    f = Fields(await read_json(request, state.config.max_body_bytes))
    name, path, model = f.string("name"), f.string("path"), f.string("model")
    if not name or not path:
        raise RequestError(400, "give the adapter's 'name' and the 'path' of its directory", "name" if not name else "path")
    try:
        added = await engine.add_adapter(name, path, model or None)
    except PermissionError as e:
        raise RequestError(403, str(e), "path", "forbidden") from None
    except UnknownModelError as e:
        raise RequestError(404, str(e), e.param, "model_not_found") from None
    except ModelUnavailableError as e:
        raise _unavailable(e) from None
    except ValueError as e:
        raise RequestError(400, str(e), "path") from None
    return JSONResponse(dict(added))


async def remove(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    asked: str = request.path_params["name"]
    model, _, name = asked.rpartition(":")  # adapter names hold no ':'
    try:
        removed = await _managing(state.engine).remove_adapter(name, model or None)
    except UnknownModelError as e:
        raise RequestError(404, str(e), e.param, "model_not_found") from None
    except ValueError as e:
        raise RequestError(400, str(e), "name") from None
    if removed is None:
        raise RequestError(404, f"no adapter named {asked!r} is loaded", "name", "model_not_found")
    return JSONResponse({"id": removed, "object": "adapter", "deleted": True})


def _managing(engine: ServeEngine) -> AdapterManaging:
    if not isinstance(engine, AdapterManaging):
        raise RequestError(404, "this server has no adapters to manage")
    return engine


def _unavailable(e: ModelUnavailableError) -> RequestError:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else {}
    return RequestError(503, str(e), "model", "model_unavailable", headers=headers)
