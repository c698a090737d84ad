"""POST /v1/cache/lookup: what a replica holds of a request's prompt, from its indexes alone
(embedded model; the shared tier's answer, "remote", is pinned in test_replicas_shared_cache.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference.prompt_cache import TieredPromptCache
from mlxkv_serve import ServeConfig, build_app

LOOKUP = "/v1/cache/lookup"
PROMPT = [504, 3458, 282, 4649, 314, 253, 1789, 30, 378, 3458, 282, 4649, 314]


def serve(binding: MlxAutoregressiveBinding, tiers: TieredPromptCache | None) -> Iterator[TestClient]:
    engine = LocalEngine(binding, tiers)
    with TestClient(build_app(engine, ServeConfig(vocab_size=binding.tokenizer.vocab_size)), raise_server_exceptions=False) as client:
        yield client
    engine.close(30)


@pytest.fixture(scope="module")
def cached(embedded: MlxAutoregressiveBinding) -> Iterator[TestClient]:
    yield from serve(embedded, TieredPromptCache(64 << 20))


@pytest.fixture(scope="module")
def uncached(embedded: MlxAutoregressiveBinding) -> Iterator[TestClient]:
    yield from serve(embedded, None)


def complete(client: TestClient, prompt: list[int]) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()["usage"]
    return usage


def test_lookup_says_what_the_next_request_will_reuse(cached: TestClient) -> None:
    assert cached.post(LOOKUP, json={"prompt": PROMPT}).json() == {
        "model": "SmolLM2-135M-Instruct-Q4_1", "prompt_tokens": 13, "cached_tokens": 0, "tier": None}
    complete(cached, PROMPT)
    longer = PROMPT + [30, 378]
    found = cached.post(LOOKUP, json={"prompt": longer}).json()
    usage = complete(cached, longer)
    assert (found["prompt_tokens"], found["cached_tokens"], found["tier"]) == (
        15, usage["prompt_tokens_details"]["cached_tokens"], "ram")
    assert found["cached_tokens"] >= 13


def test_lookup_takes_chat_bodies_and_refuses_bad_ones(cached: TestClient, uncached: TestClient) -> None:
    chat = cached.post(LOOKUP, json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["prompt_tokens"] > 1
    bad = cached.post(LOOKUP, json={"prompt": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert cached.post(LOOKUP, json={"prompt": [10**9]}).status_code == 400  # outside the vocabulary
    assert uncached.post(LOOKUP, json={"prompt": PROMPT}).json()["tier"] is None
