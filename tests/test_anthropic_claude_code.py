"""The Anthropic Messages API as Claude Code uses it, on the agent model: its captured request
(trimmed, `fixtures/claude_code_request.json`), count_tokens, thinking, the billing header."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import load_binding
from mlxkv_serve import ServeConfig, build_app
from tests.agent_model import write_agent_model

CAPTURED = Path(__file__).parent / "fixtures" / "claude_code_request.json"
HEADERS = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14", "anthropic-version": "2023-06-01"}
CONTEXT = 4096
HELLO = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    """The agent model (the embedded tokenizer and template, two tiny layers: prefill is quick),
    its context cut to 4096 tokens so that filling it is quick too."""
    binding = load_binding(str(write_agent_model(tmp_path_factory.mktemp("agent") / "model")))
    engine = LocalEngine(binding, None, context_length=CONTEXT)
    yield engine
    engine.close(30)


def client_for(engine: LocalEngine, keep_billing_header: bool = False) -> TestClient:
    config = ServeConfig(vocab_size=engine.binding.tokenizer.vocab_size, keep_billing_header=keep_billing_header)
    return TestClient(build_app(engine, config), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(engine: LocalEngine) -> Iterator[TestClient]:
    with client_for(engine) as test_client:
        yield test_client


def captured(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(CAPTURED.read_text())
    return {**body, **changes}


def count(client: TestClient, body: dict[str, Any]) -> int:
    response = client.post("/v1/messages/count_tokens?beta=true", json=body, headers=HEADERS)
    assert response.status_code == 200, response.text
    tokens: int = response.json()["input_tokens"]
    return tokens


def billing_headers_dropped(client: TestClient) -> float:
    found = re.search(r"^mlxkv_billing_headers_dropped_total (\S+)$", client.get("/metrics").text, re.MULTILINE)
    assert found is not None
    return float(found.group(1))


def test_claude_codes_request_is_answered_and_counted_alike(client: TestClient) -> None:
    """The captured request as sent (thinking, context_management, metadata, output_config,
    max_tokens 128000, a system message inside the conversation), streamed."""
    body = captured()
    assert body["max_tokens"] == 128_000 and body["thinking"]["type"] == "adaptive" and body["stream"] is True
    dropped = billing_headers_dropped(client)
    response = client.post("/v1/messages?beta=true", json=body, headers=HEADERS)
    assert response.status_code == 200, response.text
    frames = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert frames[0]["type"] == "message_start" and frames[-1]["type"] == "message_stop"
    usage = frames[-2]["usage"]
    assert count(client, body) == usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert billing_headers_dropped(client) == dropped + 1


def test_count_tokens_equals_a_generations_input_tokens(client: TestClient) -> None:
    body = {"max_tokens": 3, "system": "Be brief.", "messages": [{"role": "user", "content": "Count these words for me"}]}
    answer = client.post("/v1/messages", json=body)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert count(client, {k: v for k, v in body.items() if k != "max_tokens"}) == usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_the_billing_header_is_left_out_unless_the_server_keeps_it(engine: LocalEngine, client: TestClient) -> None:
    body = captured()
    without = copy.deepcopy(body)
    without["system"] = without["system"][1:]
    changed = copy.deepcopy(body)
    changed["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.328.1d4; cc_entrypoint=sdk-cli;"
    assert count(client, body) == count(client, without) == count(client, changed)
    with client_for(engine, keep_billing_header=True) as keeping:
        assert count(keeping, body) > count(keeping, without)


def test_thinking_blocks_in_the_history_are_left_out_of_the_prompt(client: TestClient) -> None:
    turn: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
            {"role": "user", "content": "Again"}]
    thought = copy.deepcopy(turn)
    thought[1]["content"].insert(0, {"type": "thinking", "thinking": "A greeting.", "signature": "c2ln"})
    thought[1]["content"].insert(1, {"type": "redacted_thinking", "data": "opaque"})
    assert count(client, {"messages": thought}) == count(client, {"messages": turn})


def test_max_tokens_beyond_the_context_is_lowered_not_refused(engine: LocalEngine, client: TestClient) -> None:
    def said(words: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": " hello" * words}]

    base = count(client, {"messages": said(0)})
    per_word = count(client, {"messages": said(10)}) - base
    assert per_word == 10  # one token a word, so the prompt can be sized to leave 3 tokens
    room = 3
    messages = said(engine.context_length - room - base)
    assert count(client, {"messages": messages}) == engine.context_length - room
    # The regex holds the answer open (no EOS before 50 x's), so it runs into the room left.
    response = client.post("/v1/messages", json={"max_tokens": 128_000, "messages": messages, "regex": "x{50}"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] == room and response.json()["stop_reason"] == "max_tokens"
    full = client.post("/v1/messages", json={"max_tokens": 1, "messages": said(engine.context_length)})
    assert full.status_code == 400 and f"the model's context is {engine.context_length} tokens" in full.json()["error"]["message"]


@pytest.mark.parametrize(("thinking", "max_tokens", "words"), [
    ({"type": "enabled", "budget_tokens": 1023}, 4096, ">= 1024"),
    ({"type": "enabled", "budget_tokens": 4096}, 4096, "less than max_tokens"),
    ({"type": "enabled"}, 4096, ">= 1024"),
    ({"type": "enabled", "budget_tokens": "2000"}, 4096, ">= 1024"),
    ({"type": "sometimes"}, 4096, "thinking"),
    ("on", 4096, "thinking"),
])
def test_thinking_out_of_range_is_a_400(client: TestClient, thinking: Any, max_tokens: int, words: str) -> None:
    response = client.post("/v1/messages", json={"max_tokens": max_tokens, "messages": HELLO, "thinking": thinking})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                                      {"type": "adaptive", "display": "omitted"}])
def test_thinking_is_accepted_by_a_model_that_does_not_think(client: TestClient, thinking: dict[str, Any]) -> None:
    response = client.post("/v1/messages", json={"max_tokens": 1025, "messages": HELLO, "thinking": thinking, "stop_sequences": ["."],
                                                 "metadata": {"user_id": "u"}, "context_management": {"edits": []}})
    assert response.status_code == 200, response.text
    assert [block["type"] for block in response.json()["content"]] == ["text"]


@pytest.mark.parametrize("content", [
    [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}],
    [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}],
    [{"type": "document", "source": {"type": "text", "data": "x"}}],
])
def test_images_to_a_text_only_model_are_a_400_that_says_so(client: TestClient, content: list[dict[str, Any]]) -> None:
    response = client.post("/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400
    assert "text only" in response.json()["error"]["message"]
