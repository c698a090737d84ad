"""Bad /v1/responses requests: each a 4xx in OpenAI's error shape, never a 500, and nothing stored;
float fields' edge values get a 2xx or a 4xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_serve import ServeConfig, build_app
from mlxkv_serve.responses_store import DiskResponseStore, StoredResponse

RESPONSES = "/v1/responses"
FN: dict[str, Any] = {"type": "function", "name": "f", "parameters": {"type": "object"}}
OTHER_MODEL_ID = "resp_" + "0" * 32
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


def body(**fields: Any) -> dict[str, Any]:
    return {"input": "hi", "max_output_tokens": 2, **fields}


BAD: list[tuple[str, Any, int, str | None]] = [
    ("body a list", [1], 400, None),
    ("no input", {"max_output_tokens": 2}, 400, "input"),
    ("input a number", body(input=5), 400, "input"),
    ("unknown item type", body(input=[{"type": "telepathy"}]), 400, "input[0].type"),
    ("item not an object", body(input=["hi"]), 400, "input[0]"),
    ("unknown role", body(input=[{"role": "wizard", "content": "x"}]), 400, "input[0].role"),
    ("content a number", body(input=[{"role": "user", "content": 5}]), 400, "input[0].content"),
    ("image part", body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), 400,
     "input[0].content[0]"),
    ("output without its call", body(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}]), 400, "input"),
    ("output before its call", body(input=[{"type": "function_call_output", "call_id": "c1", "output": "x"}, CALL]), 400, "input"),
    ("output without a call id", body(input=[{"type": "function_call_output", "output": "x"}]), 400, "input[0].call_id"),
    ("call arguments not JSON", body(input=[{**CALL, "arguments": "{oops"}]), 400, "input[0]"),
    ("reasoning summary a string", body(input=[{"type": "reasoning", "summary": "x"}]), 400, "input[0].summary"),
    ("only reasoning", body(input=[{"type": "reasoning", "summary": []}]), 400, "input"),
    ("previous id unknown", body(previous_response_id="resp_" + "f" * 32), 404, "previous_response_id"),
    ("previous id malformed", body(previous_response_id="../../etc/passwd"), 404, "previous_response_id"),
    ("previous id another model's", body(previous_response_id=OTHER_MODEL_ID), 400, "previous_response_id"),
    ("previous id a number", body(previous_response_id=7), 400, "previous_response_id"),
    ("namespace without tools", body(tools=[{"type": "namespace", "name": "ns", "description": "d"}]), 400, "tools[0].tools"),
    ("namespace tools empty", body(tools=[{"type": "namespace", "name": "ns", "tools": []}]), 400, "tools[0].tools"),
    ("namespace bad name", body(tools=[{"type": "namespace", "name": "a b", "tools": [FN]}]), 400, "tools[0].name"),
    ("namespace holding a hosted tool", body(tools=[{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]), 400,
     "tools[0].tools[0]"),
    ("namespace twice", body(tools=[{"type": "namespace", "name": "ns", "tools": [FN]}] * 2), 400, "tools"),
    ("namespace description a number", body(tools=[{"type": "namespace", "name": "ns", "description": 1, "tools": [FN]}]), 400,
     "tools[0].description"),
    ("unknown tool type", body(tools=[{"type": "teleport"}]), 400, "tools[0].type"),
    ("chat-shaped tool", body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools[0]"),
    ("tools not a list", body(tools={"type": "function"}), 400, "tools"),
    ("tool_choice names no tool", body(tools=[FN], tool_choice={"type": "function", "name": "g"}), 400, "tool_choice"),
    ("tool_choice required without tools", body(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice unknown", body(tool_choice="sometimes"), 400, "tool_choice"),
    ("text.format unknown", body(text={"format": {"type": "xml"}}), 400, "text.format"),
    ("text.format schema without a name", body(text={"format": {"type": "json_schema", "schema": {}}}), 400, "text.format.name"),
    ("text.format beside required tools", body(tools=[FN], tool_choice="required", text={"format": {"type": "json_object"}}),
     400, "text.format"),
    ("text a string", body(text="json"), 400, "text"),
    ("max_output_tokens zero", body(max_output_tokens=0), 400, "max_output_tokens"),
    ("max_output_tokens a float", body(max_output_tokens=2.5), 400, "max_output_tokens"),
    ("store a string", body(store="yes"), 400, "store"),
    ("stream a string", body(stream="yes"), 400, "stream"),
    ("instructions a list", body(instructions=["x"]), 400, "instructions"),
    ("metadata values numbers", body(metadata={"a": 1}), 400, "metadata"),
    ("metadata too many keys", body(metadata={str(i): "x" for i in range(17)}), 400, "metadata"),
    ("include a string", body(include="reasoning.encrypted_content"), 400, "include"),
    ("reasoning a string", body(reasoning="high"), 400, "reasoning"),
    ("reasoning.max_tokens negative", body(reasoning={"max_tokens": -1}), 400, "reasoning.max_tokens"),
    ("reasoning.max_tokens a string", body(reasoning={"max_tokens": "8"}), 400, "reasoning.max_tokens"),
    ("reasoning.max_tokens true", body(reasoning={"max_tokens": True}), 400, "reasoning.max_tokens"),
    ("truncation unknown", body(truncation="middle"), 400, "truncation"),
    ("parallel_tool_calls a string", body(parallel_tool_calls="no"), 400, "parallel_tool_calls"),
    ("client_metadata a list", body(client_metadata=[1]), 400, "client_metadata"),
    ("background", body(background=True), 400, "background"),
    ("temperature a string", body(temperature="hot"), 400, "temperature"),
    ("temperature above two", body(temperature=2.5), 400, "temperature"),
    ("temperature 10**300 (an integer of 301 digits)", body(temperature=10**300), 400, None),
    ("temperature the largest double", body(temperature=1.7976931348623157e308), 400, "temperature"),
    ("temperature negative subnormal", body(temperature=-1e-320), 400, "temperature"),
    ("top_p zero", body(top_p=0), 400, "top_p"),
    ("top_p negative zero", body(top_p=-0.0), 400, "top_p"),
    ("top_p the largest double", body(top_p=1.7976931348623157e308), 400, "top_p"),
]

EDGES_ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("temperature negative zero", body(temperature=-0.0)),
    ("temperature a subnormal", body(temperature=1e-320)),
    ("temperature the smallest subnormal", body(temperature=5e-324)),
    ("temperature a tiny normal", body(temperature=1e-300)),
    ("top_p a subnormal", body(top_p=1e-320)),
]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses")


@pytest.fixture(scope="module")
def client(embedded_native: MlxAutoregressiveBinding, store_dir: Path) -> Iterator[TestClient]:
    """On the native kernels: the edge values' answers took ~2 minutes of the module on MLX's own."""
    embedded = embedded_native
    store = DiskResponseStore(store_dir)
    store.put(StoredResponse(OTHER_MODEL_ID, "some-other-model", ({"type": "message", "role": "user",
                                                                    "content": [{"type": "input_text", "text": "x"}]},), {}))
    engine = LocalEngine(embedded, None)
    config = ServeConfig(vocab_size=embedded.tokenizer.vocab_size, max_body_bytes=64 << 10)
    with TestClient(build_app(engine, config, store), raise_server_exceptions=False) as test_client:
        yield test_client
    engine.close(30)


@pytest.mark.parametrize(("name", "request_body", "status", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_a_4xx_in_openai_shape_and_stores_nothing(client: TestClient, store_dir: Path, name: str,
                                                                 request_body: Any, status: int, param: str | None) -> None:
    before = sorted(store_dir.iterdir())
    got = client.post(RESPONSES, json=request_body)
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert sorted(store_dir.iterdir()) == before


@pytest.mark.parametrize(("name", "request_body"), EDGES_ACCEPTED, ids=[e[0] for e in EDGES_ACCEPTED])
def test_float_edge_values_are_answered_not_a_500(client: TestClient, name: str, request_body: dict[str, Any]) -> None:
    got = client.post(RESPONSES, json={**request_body, "store": False})
    assert got.status_code in (200, 400), got.text
    if got.status_code == 200:
        assert got.json()["status"] in ("completed", "incomplete")


def test_unknown_ids_are_404_for_get_and_delete(client: TestClient) -> None:
    for method in ("GET", "DELETE"):
        got = client.request(method, f"{RESPONSES}/resp_{'e' * 32}")
        assert got.status_code == 404 and got.json()["error"]["code"] == "response_not_found"


def test_corrupt_stored_response_is_not_found(client: TestClient, store_dir: Path) -> None:
    response_id = "resp_" + "c" * 32
    (store_dir / f"{response_id}.json").write_bytes(b'{"id": "resp_' + b"c" * 32 + b'", "model": ')
    assert client.get(f"{RESPONSES}/{response_id}").status_code == 404
    assert client.post(RESPONSES, json=body(previous_response_id=response_id)).status_code == 404
