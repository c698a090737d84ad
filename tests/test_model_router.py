"""`ModelRouter` on its own, over tiny in-memory models: a load in progress makes its requests wait
while the other models keep answering; idle models unload after their TTL; the router is a
`ServeEngine` and a `ModelCatalog`."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from mlxkv.engine.budgeted import BudgetedEngine
from mlxkv.engine.local_engine import LocalEngine
from mlxkv.engine.memory import MemoryBudget
from mlxkv.engine.models import LoadedModel, ModelPolicy, ModelRouter, ModelSpec
from mlxkv_serve import ModelCatalog, ServeConfig, ServeEngine, build_app
from tests.bindings import GatedBinding
from tests.factories import TINY_VOCAB, make_tiny_binding
from tests.serving import running

WAIT_S = 60.0
SEEDS = {"a": 3, "b": 5}


def tiny_loader(gate: dict[str, threading.Event], loads: list[str]) -> Callable[[ModelSpec], LoadedModel]:
    def load(spec: ModelSpec) -> LoadedModel:
        loads.append(spec.name)
        if spec.name in gate:
            assert gate[spec.name].wait(WAIT_S), "the test never opened the gate"
        engine = LocalEngine(make_tiny_binding("llama", seed=SEEDS[spec.name]), None)
        return LoadedModel(engine, 1 << 20, 1024, engine.context_length, TINY_VOCAB, engine.close)
    return load


def make_router(loader: Callable[[ModelSpec], LoadedModel], ttl_s: float = 0.0) -> ModelRouter:
    return ModelRouter([ModelSpec("a", None), ModelSpec("b", None)], loader, ModelPolicy(max_models=2, ttl_s=ttl_s),
                       budget=MemoryBudget(1 << 30), estimate=lambda spec: 1 << 20)


@pytest.fixture
def gate() -> dict[str, threading.Event]:
    return {"b": threading.Event()}


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0,
                                                    "speculative": {"mode": "off"}}, timeout=WAIT_S)


@pytest.fixture
def served(gate: dict[str, threading.Event]) -> Iterator[tuple[str, ModelRouter, list[str]]]:
    loads: list[str] = []
    router = make_router(tiny_loader(gate, loads))
    try:
        with running(build_app(router, ServeConfig(vocab_size=TINY_VOCAB))) as url:
            yield url, router, loads
    finally:
        for event in gate.values():
            event.set()
        router.close(30)


def test_the_router_is_a_serve_engine_and_a_model_catalog(served: tuple[str, ModelRouter, list[str]]) -> None:
    engine: ServeEngine = served[1]
    assert isinstance(engine, ModelCatalog)
    assert [(m.name, m.state, m.pinned) for m in served[1].models()] == [("a", "unloaded", False), ("b", "unloaded", False)]


def test_a_request_for_a_model_being_loaded_waits_while_a_loaded_one_answers(
    served: tuple[str, ModelRouter, list[str]], gate: dict[str, threading.Event]
) -> None:
    url, router, loads = served
    before = complete(url, "a").json()["choices"][0]["text"]
    waiting: list[httpx.Response] = []
    client = threading.Thread(target=lambda: waiting.append(complete(url, "b")))
    client.start()
    deadline = time.monotonic() + WAIT_S
    while [m.state for m in router.models()] != ["loaded", "loading"]:
        assert time.monotonic() < deadline, "b never started loading"
        time.sleep(0.01)
    during = [complete(url, "a") for _ in range(3)]  # b's load is stuck at the gate
    assert not waiting and client.is_alive()
    gate["b"].set()
    client.join(WAIT_S)
    assert [r.json()["choices"][0]["text"] for r in during] == [before] * 3
    assert waiting[0].status_code == 200 and waiting[0].json()["model"] == "b"


def test_an_idle_model_unloads_after_its_ttl_and_loads_again_on_demand() -> None:
    loads: list[str] = []
    router = make_router(tiny_loader({}, loads), ttl_s=0.2)
    try:
        with running(build_app(router, ServeConfig(vocab_size=TINY_VOCAB))) as url:
            first = complete(url, "a").json()["choices"][0]["text"]
            deadline = time.monotonic() + WAIT_S
            while router.models()[0].state != "unloaded":
                assert time.monotonic() < deadline, "a was never unloaded"
                time.sleep(0.02)
            again = complete(url, "a").json()["choices"][0]["text"]
    finally:
        router.close(30)
    assert (loads, again) == (["a", "a"], first)


def test_one_models_requests_wait_for_kv_room_even_checked_side_by_side_and_one_that_never_fits_is_a_400() -> None:
    binding = make_tiny_binding("llama", binding_class=GatedBinding)
    assert isinstance(binding, GatedBinding)
    local = LocalEngine(binding, None)
    # room for one request of 5 + 4 tokens at 1 KiB a token beside the 1 MiB model, not two
    engine = BudgetedEngine(local, MemoryBudget((1 << 20) + 12 * 1024), resident=1 << 20, kv_per_token=1024,
                            context_length=local.context_length)
    checks: list[int] = []
    room = engine._room

    async def side_by_side(planned: int) -> Any:  # each of the first two checks returns once both have run
        checks.append(planned)
        status = await room(planned)
        while len(checks) < 2:
            await asyncio.sleep(0.01)
        return status

    setattr(engine, "_room", side_by_side)
    results: list[httpx.Response] = []
    try:
        with running(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB))) as url:
            clients = [threading.Thread(target=lambda: results.append(complete(url, "x"))) for _ in range(2)]
            for client in clients:
                client.start()
            assert binding.entered.wait(WAIT_S)  # the first is in, held at its prefill
            time.sleep(0.3)
            assert (local.batch_size() + local.queue_depth(), len(results)) == (1, 0)  # the second waits outside
            binding.gate.set()
            for client in clients:
                client.join(WAIT_S)
            too_big = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 100}, timeout=WAIT_S)
    finally:
        binding.gate.set()
        engine.close(30)
    assert [r.status_code for r in results] == [200, 200]
    assert too_big.status_code == 400 and too_big.json()["error"]["message"] == (
        "the request plans 0.1 MiB of KV (5 prompt + 100 answer tokens at 1024 bytes a token); with the model "
        "'tiny-llama' (1.0 MiB) that passes the memory budget of 1.0 MiB (--memory-budget); ask for fewer max_tokens "
        "or send a shorter prompt")
