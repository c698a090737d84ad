"""Every float field of the generation APIs at IEEE edge values (a subnormal, -0.0, the smallest
normal, the largest finite double) is answered 2xx or 4xx in the API's shape, never a 500."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import load_binding
from mlxkv_serve import ServeConfig, build_app
from tests.agent_model import write_agent_model

EDGES = [5e-324, 1e-320, -1e-320, -0.0, sys.float_info.min, sys.float_info.max, -sys.float_info.max]
CHAT_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]
MESSAGES_FIELDS = ["temperature", "top_p"]
HELLO = [{"role": "user", "content": "Hi"}]
SWEEP = ([("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}, name) for name in CHAT_FIELDS]
         + [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, name) for name in CHAT_FIELDS]
         + [("/v1/messages", {"messages": HELLO, "max_tokens": 2}, name) for name in MESSAGES_FIELDS]
         + [("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "seed": 1}, "logit_bias")])


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    binding = load_binding(str(write_agent_model(tmp_path_factory.mktemp("agent") / "model")))  # quick to run
    engine = LocalEngine(binding, None, context_length=1024)
    config = ServeConfig(vocab_size=binding.tokenizer.vocab_size)
    with TestClient(build_app(engine, config), raise_server_exceptions=False) as test_client:
        yield test_client
    engine.close(30)


@pytest.mark.parametrize(("path", "body", "name"), SWEEP, ids=[f"{p}:{n}" for p, _, n in SWEEP])
def test_float_edges_are_answered_or_refused_never_a_500(client: TestClient, path: str, body: dict[str, Any], name: str) -> None:
    for value in EDGES:
        field: Any = {"5": value} if name == "logit_bias" else value
        response = client.post(path, json={**body, "temperature": 1.0, name: field})
        assert response.status_code in (200, 400), (value, response.text)
        if response.status_code == 400:
            payload = response.json()
            assert payload["error"]["message"] and (payload.get("type") == "error" or payload["error"]["type"] == "invalid_request_error")


def test_a_subnormal_temperature_samples_greedily(client: TestClient) -> None:
    """1e-320 is as good as 0: the same answer as greedy, not NaN from 1/T in float32."""
    # The regex keeps the answer from ending at once (this model's greedy answer is empty).
    answers = [client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 8, "temperature": t, "seed": 3,
                                                         "regex": "[a-z ]{6}"}) for t in (0.0, 1e-320)]
    assert [a.status_code for a in answers] == [200, 200]
    texts = [a.json()["choices"][0]["message"]["content"] for a in answers]
    assert len(texts[0]) == 6 and texts[0] == texts[1]
