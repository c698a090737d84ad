"""Bad requests: each gets its status code and its API's error shape, never a 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_serve import ServeConfig, build_app

CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": OK_MESSAGES, "max_tokens": 4, **fields}


BAD: list[tuple[str, str, str | bytes | dict[str, Any] | list[Any], int, str | None]] = [
    # (name, path, body, status, param)
    ("malformed json", CHAT, b"{not json", 400, None),
    ("body is a list", CHAT, [1, 2], 400, None),
    ("missing messages", CHAT, {"max_tokens": 4}, 400, "messages"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("messages not a list", CHAT, {"messages": "hello"}, 400, "messages"),
    ("message without role", CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("content is a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content"),
    ("temperature is a string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature too high", CHAT, chat(temperature=3), 400, "temperature"),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_p above one", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("max_tokens zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens a string", CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    ("n of two", CHAT, chat(n=2), 400, "n"),
    ("five stop strings", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("empty stop string", CHAT, chat(stop=[""]), 400, "stop"),
    ("logit_bias key not an id", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias id outside vocab", CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("logit_bias value too large", CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias"),
    ("negative seed", CHAT, chat(seed=-1), 400, "seed"),
    ("presence_penalty too large", CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("stream not a boolean", CHAT, chat(stream="yes"), 400, "stream"),
    ("stream_options not an object", CHAT, chat(stream_options=[1]), 400, "stream_options"),
    ("prompt longer than the context", CHAT, chat(messages=[{"role": "user", "content": "word " * 9000}]), 400, "messages"),
    ("completion without prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("completion with empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("completion prompt id outside vocab", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400, None),
    ("completion logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("completion echo", "/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
]

BAD_MESSAGES: list[tuple[str, dict[str, Any], int]] = [
    ("messages without max_tokens", {"messages": OK_MESSAGES}, 400),
    ("messages starting with assistant", {"max_tokens": 4, "messages": [{"role": "assistant", "content": "x"}]}, 400),
    ("messages with an image block", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
    ("messages temperature above one", {"max_tokens": 4, "temperature": 1.5, "messages": OK_MESSAGES}, 400),
    ("messages with a system role inside", {"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400),
]


@pytest.fixture(scope="module")
def client(embedded: MlxAutoregressiveBinding) -> Iterator[TestClient]:
    engine = LocalEngine(embedded, None)
    config = ServeConfig(vocab_size=embedded.tokenizer.vocab_size, max_body_bytes=64 << 10)
    with TestClient(build_app(engine, config), raise_server_exceptions=False) as test_client:
        yield test_client
    engine.close(30)


@pytest.fixture(scope="module")
def locked(embedded: MlxAutoregressiveBinding) -> Iterator[TestClient]:
    engine = LocalEngine(embedded, None)
    config = ServeConfig(vocab_size=embedded.tokenizer.vocab_size, api_key="s3cret")
    with TestClient(build_app(engine, config), raise_server_exceptions=False) as test_client:
        yield test_client
    engine.close(30)


def post(client: TestClient, path: str, body: Any) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_openai_request(client: TestClient, name: str, path: str, body: Any, status: int, param: str | None) -> None:
    response = post(client, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and error["param"] == param
    if name == "prompt longer than the context":
        assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("name", "body", "status"), BAD_MESSAGES, ids=[b[0] for b in BAD_MESSAGES])
def test_bad_anthropic_request(client: TestClient, name: str, body: dict[str, Any], status: int) -> None:
    response = post(client, "/v1/messages", body)
    assert response.status_code == status
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error" and payload["error"]["message"]


def test_unknown_route_and_wrong_method(client: TestClient) -> None:
    missing = client.post("/v1/nothing", json={})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = client.get(CHAT)
    assert wrong.status_code == 405 and wrong.json()["error"]["message"]


def test_oversized_body_is_413(client: TestClient) -> None:
    response = post(client, CHAT, chat(messages=[{"role": "user", "content": "x" * (70 << 10)}]))
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
    anthropic_shape = post(client, "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "x" * (70 << 10)}]})
    assert anthropic_shape.status_code == 413 and anthropic_shape.json()["error"]["type"] == "request_too_large"


def test_api_key_protects_everything_but_health(locked: TestClient) -> None:
    assert locked.get("/health").status_code == 200
    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        response = locked.get("/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    refused = locked.post("/v1/messages", json={"max_tokens": 1, "messages": OK_MESSAGES})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert locked.get("/v1/models", headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert locked.get("/metrics", headers={"x-api-key": "s3cret"}).status_code == 200
