"""GET /health, GET /metrics, GET /v1/cache/stats, POST /admin/cache/flush, GET /v1/generations/{id}."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxkv_serve.engine import HealthReporting, MemoryReporting, ModelCatalog
from mlxkv_serve.errors import RequestError
from mlxkv_serve.metrics import CONTENT_TYPE
from mlxkv_serve.state import ServerState


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    config = state.config
    # "degraded" still answers 200: the server serves, only slower (a load balancer keeps it)
    status = state.engine.health() if isinstance(state.engine, HealthReporting) else "ok"
    body: dict[str, object] = {"status": status, "model": state.engine.model_id, "cpu_kernels": config.cpu_kernels,
                               "blas": config.blas, "batch_exactness": config.batch_exactness}
    if isinstance(state.engine, MemoryReporting):  # the memory budget, the plan and the process's measured memory
        body["memory"] = dict(state.engine.memory())
    if isinstance(state.engine, ModelCatalog):  # several models: each one's state and its own status
        body["models"] = [{"name": m.name, "state": m.state, "status": m.health, "pinned": m.pinned, "error": m.error}
                          for m in state.engine.models()]
    return JSONResponse(body)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def cache_stats(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    return JSONResponse(dict(state.engine.cache_stats()))


async def cache_flush(request: Request) -> Response:
    """200 once every cached prompt state is durable on the SSD (and, with a shared tier, there
    too); 503 when writes are still pending or when any write failed since the previous flush."""
    state: ServerState = request.app.state.mlxkv
    flushed = await asyncio.to_thread(state.engine.flush, state.config.flush_timeout_s)
    if flushed.failed:
        raise RequestError(503, f"{flushed.failed} cache writes failed since the previous flush "
                                "(see the server log; is the cache disk full?)", code="writes_failed")
    if not flushed.settled:
        raise RequestError(503, "the prompt cache is not durable yet (writes still pending); retry later")
    if flushed.remote_failed:
        raise RequestError(503, f"{flushed.remote_failed} writes to the shared cache tier failed since the previous "
                                "flush (the states are on this replica's SSD only; see /health and the server log)",
                           code="remote_writes_failed")
    return JSONResponse({"durable": True, "written": flushed.written, "failed": 0, **state.engine.cache_stats()})


async def generation(request: Request) -> Response:
    state: ServerState = request.app.state.mlxkv
    found = state.engine.generation_state(request.path_params["generation_id"])
    if found is None:
        raise RequestError(404, "no generation with this id is known", "generation_id")
    return JSONResponse(dict(found))
