"""The `speculative` request field through the HTTP API: the same answer as not speculating,
in both APIs and with the server's draft model, and the drafts counted on /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import GenerationParams
from mlxkv_inference.speculative.speculation import SpeculativeParams
from mlxkv_inference.models.draft import layer_skip_draft
from mlxkv_serve import ServeConfig, build_app
from tests.factories import make_tiny_binding

# A prompt the tiny model answers by repeating itself: prompt lookup has n-grams to draft from.
ECHO = "abcabcabcabcabcabcabcabc"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    binding = make_tiny_binding("llama", seed=4)
    base = GenerationParams(speculative=SpeculativeParams(mode="off"))
    engine = LocalEngine(binding, None, base_params=base, draft=layer_skip_draft(binding, 1), max_batch=4)
    config = ServeConfig(vocab_size=binding.tokenizer.vocab_size, default_max_tokens=32, max_body_bytes=1 << 20)
    with TestClient(build_app(engine, config)) as test_client:
        yield test_client
    engine.close(30)


def completion(client: TestClient, **fields: Any) -> str:
    body = {"prompt": ECHO, "max_tokens": 32, "temperature": 0.8, "seed": 5, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


def counter(client: TestClient, name: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} is not on /metrics")


def test_every_speculative_mode_answers_like_not_speculating(client: TestClient) -> None:
    plain = completion(client)
    drafted_before = counter(client, "mlxkv_speculative_draft_tokens_total")
    for spec in ({"mode": "prompt_lookup", "num_draft_tokens": 4}, {"mode": "draft", "num_draft_tokens": 2}, {"mode": "off"}):
        assert completion(client, speculative=spec) == plain
    assert counter(client, "mlxkv_speculative_draft_tokens_total") > drafted_before
    assert counter(client, "mlxkv_speculative_accepted_tokens_total") >= 0


def test_the_anthropic_api_takes_the_field_too(client: TestClient) -> None:
    def message(**fields: Any) -> Any:
        body = {"max_tokens": 16, "messages": [{"role": "user", "content": ECHO}], **fields}
        response = client.post("/v1/messages", json=body)
        assert response.status_code == 200, response.text
        return response.json()["content"]

    assert message(speculative={"mode": "prompt_lookup"}) == message()
