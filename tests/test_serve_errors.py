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
from mlxkv_serve.config import loopback_hosts

CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": OK_MESSAGES, "max_tokens": 4, **fields}


def function(name: str, parameters: Any = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


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
    ("regex beside response_format", CHAT, chat(regex="[a-z]+", response_format={"type": "json_object"}), 400, "response_format"),
    ("user message without content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("system message with null content", CHAT, {"messages": [{"role": "system", "content": None}, *OK_MESSAGES]}, 400,
     "messages[0].content"),
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
    # hostile but well-formed JSON, refused at the edge
    ("lone high surrogate in a message", CHAT, chat(messages=[{"role": "user", "content": "a\ud800b"}]), 400, "messages[0].content"),
    ("lone low surrogate in a system prompt", CHAT, chat(messages=[{"role": "system", "content": "\udfff"}, *OK_MESSAGES]), 400,
     "messages[0].content"),
    ("reversed surrogate pair in a text part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00\ud800"}]}]),
     400, "messages[0].content[0].text"),
    ("lone surrogate in a completions prompt", "/v1/completions", {"prompt": "\ud800"}, 400, "prompt"),
    ("lone surrogate in a key", CHAT, chat(**{"\ud800": 1}), 400, None),
    ("integer of 5000 digits", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "seed": 1' + b"0" * 5000 + b"}", 400, None),
    ("integer of 5000 digits deep inside", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "x": [[{"y": 1' + b"0" * 5000 + b"}]]}",
     400, None),
    ("body nested 10000 deep", CHAT, b"[" * 10000 + b"]" * 10000, 400, None),
    ("field nested 10000 deep", CHAT, b'{"messages": ' + b"[" * 10000 + b"]" * 10000 + b"}", 400, None),
    ("field nested 100 deep", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 100 + b"]" * 100 + b"}",
     400, "x"),
    ("NaN temperature", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None),
    ("max_tokens 10**23", CHAT, chat(max_tokens=10**23), 400, None),
    ("max_tokens 1e23", CHAT, chat(max_tokens=1e23), 400, "max_tokens"),
    ("completion max_tokens 10**23", "/v1/completions", {"prompt": "x", "max_tokens": 10**23}, 400, None),
    ("temperature 10**300", CHAT, chat(temperature=10**300), 400, None),
    ("top_p 10**19", CHAT, chat(top_p=10**19), 400, "top_p"),
    # tools and structured output
    ("tool name with a space", CHAT, chat(tools=[function("get weather")]), 400, "tools[0]"),
    ("tool name too long", CHAT, chat(tools=[function("f" * 65)]), 400, "tools[0]"),
    ("tool not a function", CHAT, chat(tools=[{"type": "retrieval"}]), 400, "tools[0]"),
    ("tool parameters not an object", CHAT, chat(tools=[function("f", [1])]), 400, "tools[0]"),
    ("tool declared twice", CHAT, chat(tools=[function("f"), function("f")]), 400, "tools"),
    ("tool parameters an invalid schema", CHAT, chat(tools=[function("f", {"type": "nonsense"})]), 400, None),
    ("tool_choice names an undeclared tool", CHAT, chat(tools=[function("f")], tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice"),
    ("tool_choice required without tools", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice unknown", CHAT, chat(tools=[function("f")], tool_choice="sometimes"), 400, "tool_choice"),
    ("tool message without a call id", CHAT, chat(messages=[*OK_MESSAGES, {"role": "tool", "content": "x"}]), 400,
     "messages[1].tool_call_id"),
    ("past call arguments not JSON", CHAT, chat(messages=[*OK_MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), 400, "messages[1].tool_calls[0]"),
    ("response_format unknown type", CHAT, chat(response_format={"type": "xml"}), 400, "response_format"),
    ("response_format json_schema without a name", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     400, "response_format.json_schema.name"),
    ("response_format schema not an object", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
     400, "response_format.json_schema.schema"),
    ("response_format an invalid schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     400, None),
    ("response_format with required tools", CHAT, chat(response_format={"type": "json_object"}, tools=[function("f")], tool_choice="required"),
     400, "response_format"),
    ("speculative not an object", CHAT, chat(speculative="fast"), 400, "speculative"),
    ("speculative unknown mode", CHAT, chat(speculative={"mode": "medusa"}), 400, "speculative.mode"),
    ("speculative unknown field", CHAT, chat(speculative={"mode": "off", "ngram": 3}), 400, "speculative"),
    ("speculative zero drafts", CHAT, chat(speculative={"num_draft_tokens": 0}), 400, "speculative.num_draft_tokens"),
    ("speculative too many drafts", CHAT, chat(speculative={"num_draft_tokens": 33}), 400, "speculative.num_draft_tokens"),
    ("speculative draft without a draft model", CHAT, chat(speculative={"mode": "draft"}), 400, None),
    ("grammar that does not compile", CHAT, chat(grammar="start: foo"), 400, None),
    ("regex that does not compile", CHAT, chat(regex="a(b"), 400, None),
    ("grammar and regex", CHAT, chat(grammar="start: \"a\"", regex="a"), 400, "grammar"),
    ("legacy functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    ("completion tools", "/v1/completions", {"prompt": "x", "tools": [function("f")]}, 400, "tools"),
]

BAD_MESSAGES: list[tuple[str, dict[str, Any], int]] = [
    ("messages without max_tokens", {"messages": OK_MESSAGES}, 400),
    ("messages speculative unknown mode", {"max_tokens": 4, "messages": OK_MESSAGES, "speculative": {"mode": "x"}}, 400),
    ("messages starting with assistant", {"max_tokens": 4, "messages": [{"role": "assistant", "content": "x"}]}, 400),
    ("messages with an image block", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
    ("messages temperature above one", {"max_tokens": 4, "temperature": 1.5, "messages": OK_MESSAGES}, 400),
    ("messages with a system role inside", {"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400),
    ("messages lone surrogate in a message", {"max_tokens": 4, "messages": [{"role": "user", "content": "\ud800"}]}, 400),
    ("messages reversed pair in a block", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00\ud800"}]}]}, 400),
    ("messages lone surrogate in system", {"max_tokens": 4, "system": "\udfff", "messages": OK_MESSAGES}, 400),
    ("messages max_tokens 10**23", {"max_tokens": 10**23, "messages": OK_MESSAGES}, 400),
    ("messages temperature 10**300", {"max_tokens": 4, "temperature": 10**300, "messages": OK_MESSAGES}, 400),
    ("messages nested 10000 deep", {"max_tokens": 4, "messages": OK_MESSAGES, "metadata": "NEST"}, 400),
    ("messages tool name with a dot", {"max_tokens": 4, "messages": OK_MESSAGES, "tools": [{"name": "a.b", "input_schema": {"type": "object"}}]}, 400),
    ("messages tool without input_schema", {"max_tokens": 4, "messages": OK_MESSAGES, "tools": [{"name": "f"}]}, 400),
    ("messages tool_choice any without tools", {"max_tokens": 4, "messages": OK_MESSAGES, "tool_choice": {"type": "any"}}, 400),
    ("messages tool_choice an undeclared tool", {"max_tokens": 4, "messages": OK_MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                                               "tool_choice": {"type": "tool", "name": "g"}}, 400),
    ("messages tool input_schema an invalid schema", {"max_tokens": 4, "messages": OK_MESSAGES, "tool_choice": {"type": "any"},
                                                     "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]}, 400),
    ("messages tool_result without an id", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, 400),
    ("messages tool_use in a user turn", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, 400),
]


@pytest.fixture(scope="module")
def client(embedded_native: MlxAutoregressiveBinding) -> Iterator[TestClient]:
    engine = LocalEngine(embedded_native, None)
    config = ServeConfig(vocab_size=embedded_native.tokenizer.vocab_size, max_body_bytes=64 << 10)
    with TestClient(build_app(engine, config), raise_server_exceptions=False) as test_client:
        yield test_client
    engine.close(30)


@pytest.fixture(scope="module")
def locked(embedded_native: MlxAutoregressiveBinding) -> Iterator[TestClient]:
    engine = LocalEngine(embedded_native, None)
    config = ServeConfig(vocab_size=embedded_native.tokenizer.vocab_size, api_key="s3cret")
    with TestClient(build_app(engine, config), raise_server_exceptions=False) as test_client:
        yield test_client
    engine.close(30)


def post(client: TestClient, path: str, body: Any) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    content = content.replace(b'"NEST"', b"[" * 10000 + b"]" * 10000)
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


NO_OPS: list[tuple[str, str, dict[str, Any]]] = [
    ("empty tools", CHAT, chat(tools=[])),
    ("tool_choice none", CHAT, chat(tool_choice="none")),
    ("tool_choice auto", CHAT, chat(tool_choice="auto")),
    ("text response_format", CHAT, chat(response_format={"type": "text"})),
    ("anthropic empty tools", "/v1/messages", {"max_tokens": 1, "messages": OK_MESSAGES, "tools": []}),
    ("anthropic tool_choice auto", "/v1/messages", {"max_tokens": 1, "messages": OK_MESSAGES, "tool_choice": {"type": "auto"}}),
]


@pytest.mark.parametrize(("name", "path", "body"), NO_OPS, ids=[n[0] for n in NO_OPS])
def test_no_op_forms_of_tool_fields_are_accepted(client: TestClient, name: str, path: str, body: dict[str, Any]) -> None:
    assert post(client, path, {**body, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/messages"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_generation_needs_a_json_content_type(client: TestClient, path: str, content_type: str | None) -> None:
    body = json.dumps({"max_tokens": 1, "messages": OK_MESSAGES, "prompt": "x"}).encode()
    response = client.post(path, content=body, headers={"content-type": content_type} if content_type else {})
    assert response.status_code == 415
    payload = response.json()
    error_type = payload["error"]["type"]
    assert error_type == "invalid_request_error" and "application/json" in payload["error"]["message"]
    assert (payload.get("type") == "error") == (path == "/v1/messages")


def test_json_content_type_with_parameters_is_accepted(client: TestClient) -> None:
    body = json.dumps(chat(max_tokens=1)).encode()
    assert client.post(CHAT, content=body, headers={"content-type": "Application/JSON; charset=utf-8"}).status_code == 200


def test_loopback_server_refuses_foreign_host_headers(embedded_native: MlxAutoregressiveBinding) -> None:
    engine = LocalEngine(embedded_native, None)
    config = ServeConfig(vocab_size=embedded_native.tokenizer.vocab_size, allowed_hosts=loopback_hosts("127.0.0.1"))
    try:
        with TestClient(build_app(engine, config), raise_server_exceptions=False) as local:
            for host in ("127.0.0.1", "127.0.0.1:8080", "localhost", "LocalHost:8080"):
                assert local.get("/v1/models", headers={"host": host}).status_code == 200, host
            for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.evil.example:80", "[::1]:8080", ""):
                refused = local.get("/v1/models", headers={"host": host})
                assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error", host
            anthropic_shape = local.post("/v1/messages", json={"max_tokens": 1, "messages": OK_MESSAGES}, headers={"host": "evil.example"})
            assert anthropic_shape.status_code == 403 and anthropic_shape.json()["type"] == "error"
    finally:
        engine.close(30)


def test_loopback_hosts_lists_the_bound_address_and_localhost() -> None:
    assert loopback_hosts("127.0.0.1") == frozenset({"127.0.0.1", "localhost"})
    assert loopback_hosts("::1") == frozenset({"[::1]", "localhost"})
    assert loopback_hosts("localhost") == frozenset({"localhost", "127.0.0.1", "[::1]"})
    assert loopback_hosts("127.0.0.2") == frozenset({"127.0.0.2", "localhost"})
    assert loopback_hosts("0.0.0.0") is None and loopback_hosts("192.168.1.7") is None


def test_an_empty_api_key_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="API key is empty"):
        ServeConfig(vocab_size=10, api_key="")


def test_api_key_scheme_is_case_insensitive_and_required(locked: TestClient) -> None:
    for value in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):
        assert locked.get("/v1/models", headers={"authorization": value}).status_code == 200, value
    for value in ("s3cret", "Basic s3cret", "Token s3cret", "Bearer", "bearers3cret"):
        refused = locked.get("/v1/models", headers={"authorization": value})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error", value


def test_api_key_protects_everything_but_health(locked: TestClient) -> None:
    assert locked.get("/health").status_code == 200
    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        response = locked.get("/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    refused = locked.post("/v1/messages", json={"max_tokens": 1, "messages": OK_MESSAGES})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert locked.get("/v1/models", headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert locked.get("/metrics", headers={"x-api-key": "s3cret"}).status_code == 200


def test_one_model_is_retrieved_by_its_id_and_another_id_is_a_404(client: TestClient) -> None:
    served = client.get("/v1/models").json()["data"][0]
    assert client.get(f"/v1/models/{served['id']}").json() == served
    missing = client.get("/v1/models/gpt-4o")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found" and served["id"] in missing.json()["error"]["message"]


PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization, content-type"}


def test_browsers_on_local_pages_may_call_the_api_others_only_when_allowed(locked: TestClient,
                                                                              embedded_native: MlxAutoregressiveBinding) -> None:
    for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "https://localhost", "http://[::1]:5173"):
        # a preflight carries no API key: answered before the key check
        allowed = locked.options(CHAT, headers={"origin": origin, **PREFLIGHT})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == origin, origin
        refused = locked.get("/v1/models", headers={"origin": origin})  # a refusal the page can read
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin
    for origin in ("https://evil.example", "http://localhost.evil.example", "http://127.0.0.1.evil.example:80"):
        assert locked.options(CHAT, headers={"origin": origin, **PREFLIGHT}).status_code == 400, origin
        assert "access-control-allow-origin" not in locked.get("/v1/models", headers={"origin": origin}).headers
    engine = LocalEngine(embedded_native, None)
    for origins, origin, echoed in ((("https://chat.example",), "https://chat.example", "https://chat.example"),
                                    (("*",), "https://any.example", "*")):
        config = ServeConfig(vocab_size=embedded_native.tokenizer.vocab_size, cors_origins=origins)
        with TestClient(build_app(engine, config), raise_server_exceptions=False) as open_to:
            assert open_to.options(CHAT, headers={"origin": origin, **PREFLIGHT}).status_code == 200
            assert open_to.get("/v1/models", headers={"origin": origin}).headers["access-control-allow-origin"] == echoed
    engine.close(30)
