"""POST /v1/adapters (name + path, under the operator's --adapter-dir only) and DELETE /v1/adapters/{name}."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxkv_serve.body import read_json
from mlxkv_serve.engine import AdapterManaging, ServeEngine
from mlxkv_serve.errors import RequestError
from mlxkv_serve.fields import Fields
from mlxkv_serve.state import ServerState


async def add(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    engine = _managing(state.engine)
    f = Fields(await read_json(request, state.config.max_body_bytes))
    name, path = f.string("name"), f.string("path")
    if not name or not path:
        raise RequestError(400, "give the adapter's 'name' and the 'path' of its directory", "name" if not name else "path")
    try:
        added = await engine.add_adapter(name, path)
    except PermissionError as e:
        raise RequestError(403, str(e), "path", "forbidden") from None
    except ValueError as e:
        raise RequestError(400, str(e), "path") from None
    return JSONResponse(dict(added))


async def remove(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    name = request.path_params["name"]
    if not _managing(state.engine).remove_adapter(name):
        raise RequestError(404, f"no adapter named {name!r} is loaded", "name", "model_not_found")
    return JSONResponse({"id": f"{state.engine.model_id}:{name}", "object": "adapter", "deleted": True})


def _managing(engine: ServeEngine) -> AdapterManaging:
    if not isinstance(engine, AdapterManaging):
        raise RequestError(404, "this server has no adapters to manage")
    return engine
