"""Structured output and tool calls with the embedded model, through the official SDKs on a live
server: every answer asked to follow a schema parses and validates (the full 20-schema run is
tools/structured_acceptance.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from mlxkv.engine.cache_services import build_tiers
from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_serve import ServeConfig, build_app
from tests.serving import running

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"item": {"type": "string", "maxLength": 16}, "size": {"enum": ["small", "large"]}},
        "required": ["item", "size"], "additionalProperties": False}},
    "total": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["items", "total"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
OPENAI_TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}}]
ANTHROPIC_TOOLS: Any = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url(embedded_native: MlxAutoregressiveBinding, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tiers, _ = build_tiers(embedded_native, ram_bytes=1 << 30, ssd_dir=tmp_path_factory.mktemp("ssd"), ssd_bytes=1 << 30)
    engine = LocalEngine(embedded_native, tiers)
    with running(build_app(engine, ServeConfig(vocab_size=embedded_native.tokenizer.vocab_size, max_body_bytes=1 << 20))) as url:
        yield url
    engine.close(30)


@pytest.mark.parametrize(("schema", "sampling"), [(PERSON, {"temperature": 0}), (ORDER, {"temperature": 0.8, "seed": 11})],
                         ids=["person-greedy", "order-seeded"])
def test_embedded_json_schema_answers_parse_and_validate(base_url: str, schema: dict[str, Any], sampling: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Reply with a small example as JSON."}], max_tokens=128,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}, **sampling)
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)


def test_embedded_openai_tool_round_trip(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=ASK, tools=OPENAI_TOOLS, tool_choice="required", max_tokens=48,
                                            temperature=0, stream=True)
    calls = [call for chunk in stream if chunk.choices and chunk.choices[0].delta.tool_calls for call in chunk.choices[0].delta.tool_calls]
    assert len(calls) >= 1 and calls[0].function and calls[0].function.name == "get_weather" and calls[0].id
    arguments = calls[0].function.arguments or ""
    jsonschema.validate(json.loads(arguments), WEATHER)
    history: Any = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 degrees and sunny"}]
    final = client.chat.completions.create(model="m", messages=history, tools=OPENAI_TOOLS, tool_choice="none", max_tokens=24, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


def test_embedded_anthropic_tool_use_round_trip(base_url: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    # One call: within 48 tokens a second one would be cut, and the answer would end "max_tokens".
    reply = client.messages.create(model="m", max_tokens=48, messages=ASK, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    history: Any = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 degrees and sunny"}]}]
    with client.messages.stream(model="m", max_tokens=24, messages=history, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    for block in final.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, WEATHER)
        else:
            assert block.type == "text"
