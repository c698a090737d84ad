"""Gemma 4 calls on a tiny random-weight model with Gemma 4's real chat template: a JSON schema's
nested objects, arrays, numbers, booleans, bounded strings and optional keys translate into Gemma 4's
argument syntax, and what the grammar forces is read back by mlx-lm's `gemma4` parser as arguments
that match the schema; a schema the template cannot render is a 400, not a 500."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from mlxkv.engine.local_engine import LocalEngine
from mlxkv.engine.tool_calls import ToolUse, chat_messages, split_tool_calls, template_tools
from mlxkv.engine.tool_formats import model_tool_format
from mlxkv_inference import Generation, GenerationParams, compile_grammar
from mlxkv_inference.tokenizer.chat import encode_chat
from mlxkv_serve import ChatMessage, ServeConfig, Tool, ToolCall, build_app
from tests.chat_templates import TemplateTokenizer
from tests.factories import TINY_VOCAB, make_tiny_binding

PLAN = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 5},
    "steps": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "maxItems": 3},
    "urgent": {"type": "boolean"},
    "cost": {"type": "number"},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "enum": ["ann", "bob"]}, "age": {"type": "integer"}},
              "required": ["name"]},
}, "required": ["owner", "steps"], "additionalProperties": False}
TOOL = Tool("plan", "Make a plan", json.dumps(PLAN))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_forced_call_is_gemma4_syntax_that_parses_into_schema_valid_arguments(seed: int) -> None:
    tokenizer = TemplateTokenizer("gemma4")
    fmt = model_tool_format(tokenizer)
    prompt = encode_chat(tokenizer, chat_messages((ChatMessage("user", "Plan it"),), (TOOL,), True), template_tools((TOOL,))).tokens
    grammar = ToolUse((TOOL,), (TOOL,), True, False, fmt).grammar()
    result = Generation(make_tiny_binding("qwen3", seed=seed, tokenizer=tokenizer), prompt,
                        GenerationParams(max_tokens=200, grammar=grammar)).run()
    assert result.finish_reason == "stop", result.text
    assert result.text.startswith("<|tool_call>call:plan{") and result.text.endswith("}<tool_call|>")
    text, calls = split_tool_calls(result.text, (TOOL,), "g", fmt)
    assert text == "" and [c.name for c in calls] == ["plan"]
    arguments: Any = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, PLAN)
    assert list(arguments) == sorted(arguments)  # keys in the order the template writes them


def test_a_schema_the_template_cannot_render_is_a_400() -> None:
    """Gemma 4's template reads every property's `type`: a property without one fails it."""
    engine = LocalEngine(make_tiny_binding("qwen3", seed=1, tokenizer=TemplateTokenizer("gemma4")), None)
    try:
        with TestClient(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB)), raise_server_exceptions=False) as client:
            tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"enum": ["a"]}}}}}
            got = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                            "tools": [tool]})
    finally:
        engine.close(30)
    assert got.status_code == 400 and "chat template error" in got.json()["error"]["message"]


def test_results_go_back_as_the_calling_turns_tool_responses() -> None:
    """Gemma 4's template writes a call's results right after it, in the same model turn, and the
    model goes on from there (no new turn is opened)."""
    tokenizer = TemplateTokenizer("gemma4")
    weather = Tool("get_weather", "Weather", json.dumps({"type": "object", "properties": {"unit": {"type": "string"}}}))
    calls = (ToolCall("c1", "get_weather", '{"unit": "c"}'), ToolCall("c2", "get_weather", '{"unit": "f"}'))
    history = (ChatMessage("user", "Weather?"), ChatMessage("assistant", "", tool_calls=calls),
               ChatMessage("tool", "sunny", tool_call_id="c1"), ChatMessage("tool", '{"temp": 20}', tool_call_id="c2"))
    fmt = model_tool_format(tokenizer)
    text = tokenizer.apply_chat_template(chat_messages(history, (weather,), True, fmt), tools=template_tools((weather,)))
    assert text[text.index("<|turn>model"):] == (
        '<|turn>model\n<|tool_call>call:get_weather{unit:<|"|>c<|"|>}<tool_call|>'
        '<|tool_call>call:get_weather{unit:<|"|>f<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'
        "<|tool_response>response:get_weather{temp:20}<tool_response|>"
        "<|channel>thought\n<channel|>")


@pytest.mark.parametrize("schema", [{"type": "object", "properties": ["x"]}, {"type": "object", "required": "x"}, True,
                                    {"type": "object", "properties": {'a"b\\c': {"type": "string"}}}])
def test_odd_schemas_make_a_grammar_that_compiles(schema: object) -> None:
    tokenizer = TemplateTokenizer("gemma4")
    tool = Tool("f", "", json.dumps(schema))
    compile_grammar(ToolUse((tool,), (tool,), True, False, model_tool_format(tokenizer)).grammar(), tokenizer)
