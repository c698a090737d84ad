"""A router's `/health` reports each model's state and its own status beside the one-model
fields, and `/v1/cache/lookup` answers for the request's `model` from that model's tiers (a model
not loaded is not loaded to answer; an unknown one is a 404)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from mlxkv.engine.local_engine import LocalEngine
from mlxkv.engine.memory import MemoryBudget
from mlxkv.engine.models import LoadedModel, ModelPolicy, ModelRouter, ModelSpec
from mlxkv_inference.prompt_cache import TieredPromptCache
from mlxkv_serve import ServeConfig, build_app
from tests.factories import TINY_VOCAB, make_tiny_binding
from tests.serving import running
from tests.test_model_router import SEEDS, WAIT_S, complete

PROMPT = "the quick brown fox jumps over the lazy dog"


def cached_loader(spec: ModelSpec) -> LoadedModel:
    engine = LocalEngine(make_tiny_binding("llama", seed=SEEDS[spec.name]), TieredPromptCache(8 << 20))
    return LoadedModel(engine, 1 << 20, 1024, engine.context_length, TINY_VOCAB, engine.close)


@pytest.fixture
def served() -> Iterator[tuple[str, ModelRouter]]:
    router = ModelRouter([ModelSpec("a", None), ModelSpec("b", None)], cached_loader, ModelPolicy(max_models=2),
                         budget=MemoryBudget(1 << 30), estimate=lambda spec: 1 << 20)
    try:
        with running(build_app(router, ServeConfig(vocab_size=TINY_VOCAB))) as url:
            yield url, router
    finally:
        router.close(30)


def lookup(url: str, model: str, prompt: str) -> httpx.Response:
    return httpx.post(url + "/v1/cache/lookup", json={"model": model, "prompt": prompt}, timeout=WAIT_S)


def test_health_reports_every_models_state_beside_the_one_model_fields(served: tuple[str, ModelRouter]) -> None:
    url, _ = served
    assert complete(url, "a").status_code == 200
    health = httpx.get(url + "/health").json()
    assert set(health) == {"status", "model", "cpu_kernels", "blas", "batch_exactness", "models", "memory"}
    assert (health["status"], health["model"]) == ("ok", "a")
    # a budget without a gauge counts the plan alone: the loaded model, its request ended
    assert health["memory"] == {"budget_bytes": 1 << 30, "planned_bytes": 1 << 20, "measured_bytes": None,
                                "unplanned_bytes": 0, "in_use_bytes": 1 << 20, "rss_bytes": None, "mlx_active_bytes": None,
                                "mlx_cache_bytes": None}
    assert health["models"] == [{"name": "a", "state": "loaded", "status": "ok", "pinned": False, "error": None},
                                {"name": "b", "state": "unloaded", "status": None, "pinned": False, "error": None}]


def test_lookup_answers_from_the_asked_models_tiers_and_loads_nothing(served: tuple[str, ModelRouter]) -> None:
    url, router = served
    first = httpx.post(url + "/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 2, "temperature": 0},
                       timeout=WAIT_S)
    assert first.status_code == 200
    held = lookup(url, "a", PROMPT + " again").json()
    again = httpx.post(url + "/v1/completions", json={"model": "a", "prompt": PROMPT + " again", "max_tokens": 2},
                       timeout=WAIT_S).json()["usage"]
    assert held == {"model": "a", "prompt_tokens": again["prompt_tokens"],
                    "cached_tokens": again["prompt_tokens_details"]["cached_tokens"], "tier": "ram", "state": "loaded"}
    assert held["cached_tokens"] > 0
    assert lookup(url, "b", PROMPT).json() == {"model": "b", "prompt_tokens": None, "cached_tokens": 0, "tier": None,
                                               "state": "unloaded"}
    unknown = lookup(url, "zzz", PROMPT)
    assert [m.state for m in router.models()] == ["loaded", "unloaded"]
    assert (unknown.status_code, unknown.json()["error"]["code"], unknown.json()["error"]["param"]) == (
        404, "model_not_found", "model")
