"""`ModelRouter`'s adapters over HTTP on tiny in-memory models: a model's bound adapters (its
spec's) are applied at each load, and removing one while the model loads waits for the load, so the
loaded model goes without it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from mlxkv.engine.local_engine import LocalEngine
from mlxkv.engine.memory import MemoryBudget
from mlxkv.engine.models import BoundAdapter, LoadedModel, ModelPolicy, ModelRouter, ModelSpec
from mlxkv_serve import ServeConfig, build_app
from mlxkv_serve.engine import AdapterManaging
from tests.adapter_factories import write_random_adapter
from tests.factories import TINY_VOCAB, make_tiny_binding
from tests.serving import running

WAIT_S = 60.0


def test_removing_an_adapter_while_its_model_loads_waits_for_the_load_and_the_model_goes_without_it(tmp_path: Path) -> None:
    adapter = write_random_adapter(make_tiny_binding("llama", seed=5), tmp_path / "x", seed=1)
    gate = threading.Event()

    def load(spec: ModelSpec) -> LoadedModel:
        assert gate.wait(WAIT_S), "the test never opened the gate"
        engine = LocalEngine(make_tiny_binding("llama", seed=5 if spec.name == "b" else 3), None)
        for bound in spec.adapters:  # as `mlxkv serve` does: the spec the load was started with
            engine.adapters.add(bound.name, bound.path)
        return LoadedModel(engine, 1 << 20, 1024, engine.context_length, TINY_VOCAB, engine.close)

    specs = [ModelSpec("a", None), ModelSpec("b", None, (BoundAdapter("x", adapter),))]
    router = ModelRouter(specs, load, ModelPolicy(max_models=2), budget=MemoryBudget(1 << 30), estimate=lambda spec: 1 << 20)
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "speculative": {"mode": "off"}}
    try:
        with running(build_app(router, ServeConfig(vocab_size=TINY_VOCAB))) as url, ThreadPoolExecutor(2) as pool:
            base = pool.submit(httpx.post, url + "/v1/completions", json={**body, "model": "b"}, timeout=WAIT_S)
            _wait_for(lambda: [m.state for m in router.models()] == ["unloaded", "loading"])
            removed = pool.submit(httpx.delete, url + "/v1/adapters/b:x", timeout=WAIT_S)
            time.sleep(0.3)  # the DELETE is waiting for the load
            waited = not removed.done()
            gate.set()
            answered, deleted = base.result(), removed.result()
            adapted = httpx.post(url + "/v1/completions", json={**body, "model": "b:x"}, timeout=WAIT_S)
            listed = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    finally:
        gate.set()
        router.close(30)
    assert deleted.json() == {"id": "b:x", "object": "adapter", "deleted": True}
    assert adapted.status_code == 404 and adapted.json()["error"]["message"] == (
        "no adapter named 'x' is loaded (in 'model'); loaded: none")
    assert listed == ["a", "b"] and isinstance(router, AdapterManaging)
    assert waited and answered.status_code == 200


def _wait_for(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
