"""Tool calls in each model family's own format, on tiny random-weight models that carry the family's
chat template and marker tokens: the format chosen from the template, the call its grammar forces
(parsed into schema-valid arguments), and the same call through /v1/chat/completions and /v1/messages."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from mlxkv.engine.harmony import harmony_grammar
from mlxkv.engine.local_engine import LocalEngine
from mlxkv.engine.reasoning import think_tags
from mlxkv.engine.thinking import think_plan
from mlxkv.engine.tool_calls import ToolUse, chat_messages, family_history, split_tool_calls, template_tools
from mlxkv.engine.tool_formats import model_tool_format
from mlxkv_inference import Generation, GenerationParams
from mlxkv_inference.tokenizer.chat import encode_chat
from mlxkv_serve import ChatMessage, ServeConfig, Tool, ToolCall, build_app
from tests.chat_templates import FAMILIES, TemplateTokenizer
from tests.factories import TINY_VOCAB, ByteTokenizer, QwenStyleByteTokenizer, make_tiny_binding

WEATHER = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "city": {"type": "string", "maxLength": 6}},
           "required": ["unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = (Tool("get_weather", "Weather forecast", json.dumps(WEATHER)), Tool("get_time", "The time", json.dumps(CLOCK)))
ASK = (ChatMessage("user", "Weather in Paris?"),)
MAX_TOKENS = 160

FORMATS = {"qwen3": "hermes", "qwen3_coder": "qwen3_coder", "llama3_1": "llama3_json", "mistral_nemo": "mistral",
           "mistral_small_3_2": "mistral_args", "gpt_oss": "harmony", "gemma4": "gemma4"}
# How each family's call begins, as its template renders a past call.
CALL_STARTS = {
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"unit": ',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=unit>\n",
    "llama3_1": '{"name": "get_weather", "parameters": {"unit": ',
    "mistral_nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"unit": ',
    "mistral_small_3_2": '[TOOL_CALLS]get_weather[ARGS]{"unit": ',
    "gpt_oss": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"unit": ',
    "gemma4": "<|tool_call>call:get_weather{",
}
# Families whose answers are asked with thinking off (budget 0), through the APIs as in the oracle.
NO_ANALYSIS = {"gpt_oss"}
# Where a past call begins where its template renders it other than the model writes it.
RENDERED_STARTS = {"gpt_oss": "<|start|>assistant to=functions."}


def test_the_format_is_chosen_from_the_template_and_its_marker_tokens() -> None:
    assert {family: model_tool_format(TemplateTokenizer(family)).name for family in FAMILIES} == FORMATS
    assert model_tool_format(ByteTokenizer()).name == "hermes"  # no template: tools described in the Hermes format
    assert model_tool_format(QwenStyleByteTokenizer()).name == "hermes"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_past_call_renders_as_the_family_writes_it_and_parses_back(family: str) -> None:
    """The template renders our call history in the family's format, which the family's parser reads."""
    tokenizer = TemplateTokenizer(family)
    fmt = model_tool_format(tokenizer)
    call = ToolCall("abcdefghi", "get_weather", '{"unit": "c", "days": 2}')  # Mistral v3 wants 9-character ids
    history = (*ASK, ChatMessage("assistant", "", tool_calls=(call,)))
    text = tokenizer.apply_chat_template(chat_messages(history, TOOLS, True), add_generation_prompt=False,
                                         tools=template_tools(TOOLS))
    rendered = text[text.index(RENDERED_STARTS.get(family, fmt.start), text.index("Weather in Paris?")):]
    for end in ("<|im_end|>", "<|eot_id|>", "<eos>", "<|call|>", "<turn|>"):  # the turn's end, as each family writes it
        rendered = rendered.split(end)[0]
    assert fmt.parse(rendered, TOOLS) == [("get_weather", {"unit": "c", "days": 2})]
    if family not in RENDERED_STARTS:
        text, calls = split_tool_calls(rendered, TOOLS, "g", fmt)
        assert (text, [(c.id, c.name, json.loads(c.arguments)) for c in calls]) == ("", [("g_0", "get_weather", {"unit": "c", "days": 2})])


def forced_call(family: str, seed: int) -> tuple[str, tuple[ToolCall, ...]]:
    """The oracle: the answer the grammar forces when `get_weather` must be called (one call),
    generated directly (greedy), and its calls as the family's parser reads them."""
    tokenizer = TemplateTokenizer(family)
    binding = make_tiny_binding("qwen3", seed=seed, tokenizer=tokenizer)
    fmt = model_tool_format(tokenizer)
    prompt = encode_chat(tokenizer, chat_messages(ASK, TOOLS, True), template_tools(TOOLS)).tokens
    if family in NO_ANALYSIS:  # harmony's analysis channel left out (a random model would not end it)
        grammar = harmony_grammar(TOOLS[:1], required=True, budget=0, literal=fmt.literal)
    else:
        grammar = ToolUse(TOOLS, TOOLS[:1], True, False, fmt).grammar(think_plan(think_tags(tokenizer), prompt, None))
    result = Generation(binding, prompt, GenerationParams(max_tokens=MAX_TOKENS, grammar=grammar)).run()
    assert result.finish_reason == "stop", result.text
    answer = result.text.split("</think>")[-1].lstrip("\n").split("<|start|>assistant")[-1]  # after any reasoning
    return answer, split_tool_calls(answer, TOOLS, "g", fmt)[1]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, TestClient]]:
    family: str = request.param
    engine = LocalEngine(make_tiny_binding("qwen3", seed=5, tokenizer=TemplateTokenizer(family)), None)
    with TestClient(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB)), raise_server_exceptions=False) as client:
        yield family, client
    engine.close(30)


def test_the_forced_call_is_the_familys_format_with_schema_valid_arguments(served: tuple[str, TestClient]) -> None:
    family, client = served
    answer, calls = forced_call(family, seed=5)
    assert answer.startswith(CALL_STARTS[family]), answer
    assert [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    tools: Any = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters)}}
                  for t in TOOLS]
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": MAX_TOKENS, "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
            **({"thinking_token_budget": 0} if family in NO_ANALYSIS else {})}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"].get("content")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [(c.name, json.loads(c.arguments)) for c in calls]
    anthropic_tools = [{"name": t.name, "description": t.description, "input_schema": json.loads(t.parameters)} for t in TOOLS]
    message = client.post("/v1/messages", json={"messages": body["messages"], "max_tokens": MAX_TOKENS, "tools": anthropic_tools,
                                                "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                                                **({"thinking": {"type": "disabled"}} if family in NO_ANALYSIS else {})}).json()
    assert message["stop_reason"] == "tool_use"
    assert [(b["name"], b["input"]) for b in message["content"] if b["type"] == "tool_use"] \
        == [(c.name, json.loads(c.arguments)) for c in calls]


def test_a_history_of_calls_with_client_ids_renders_in_every_family(served: tuple[str, TestClient]) -> None:
    """Mistral's templates refuse call ids that are not 9 letters and digits: clients' ids are mapped
    (alike in the call and its result); the other families take them as they are."""
    family, client = served
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7f3a", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"unit": "c", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_7f3a", "content": "sunny"}]
    response = client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2})
    assert response.status_code == 200, response.text
    mapped = family_history(tuple(ChatMessage("tool", "sunny", tool_call_id=i) for i in ("call_7f3a", "abcdefghi")),
                            model_tool_format(TemplateTokenizer(family)))
    expected = [hashlib.sha256(b"call_7f3a").hexdigest()[:9], "abcdefghi"] if family.startswith("mistral") else ["call_7f3a", "abcdefghi"]
    assert [m.tool_call_id for m in mapped] == expected
