"""Tool calls with tiny random-weight models: a Qwen-style template that takes `tools`, the parser of
its `<tool_call>` format, and both APIs through the official SDKs (the grammar guarantees the calls)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from mlxkv.engine.local_engine import LocalEngine
from mlxkv.engine.tool_calls import ToolAnswer, ToolUse, chat_messages, split_tool_calls, template_tools, tool_grammar
from mlxkv_inference import GenerationParams, Generation, compile_grammar
from mlxkv_inference.tokenizer.chat import encode_chat, template_takes_tools
from mlxkv_serve import ChatMessage, ServeConfig, Tool, ToolCall, build_app
from tests.factories import TINY_VOCAB, ByteTokenizer, QwenStyleByteTokenizer, make_prompt, make_tiny_binding
from tests.serving import running

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = (Tool("get_weather", "Weather forecast", json.dumps(WEATHER)), Tool("get_time", "The time", json.dumps(CLOCK)))
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
OPENAI_TOOLS: Any = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": SCHEMAS[t.name]}}
                     for t in TOOLS]
ANTHROPIC_TOOLS: Any = [{"name": t.name, "description": t.description, "input_schema": SCHEMAS[t.name]} for t in TOOLS]
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]


CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'


def test_parser_reads_calls_of_declared_tools_and_keeps_the_rest_as_text() -> None:
    text = CALL + '\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    assert split_tool_calls(text, TOOLS, "g") == ("", (ToolCall("g_0", "get_time", '{"zone": "utc"}'),))
    cut = '<tool_call>\n{"name": "get_time", "argu'
    assert split_tool_calls(cut, TOOLS, "g") == ("", ())  # the markup of a call cut short is no answer
    assert split_tool_calls("<tool_", TOOLS, "g") == ("", ())
    assert split_tool_calls(CALL + "\n" + cut, TOOLS, "g") == ("", (ToolCall("g_0", "get_time", '{"zone": "utc"}'),))
    assert split_tool_calls("Sure. " + CALL, TOOLS, "g") == ("Sure. " + CALL, ())  # free text (the grammar's other branch)


def test_free_text_streams_while_calls_wait_for_the_whole_answer() -> None:
    active = ToolUse(TOOLS, TOOLS)
    text = ToolAnswer(active, "g")
    assert [text.feed(part) for part in ("", "Hel", "lo <x>")] == ["", "Hel", "lo <x>"] and text.finish("Hello <x>") == ("", ())
    call = ToolAnswer(active, "g")
    assert [call.feed(part) for part in (CALL[:5], CALL[5:])] == ["", ""]
    assert call.finish(CALL) == ("", (ToolCall("g_0", "get_time", '{"zone": "utc"}'),))


def test_template_that_takes_tools_renders_them_and_the_history() -> None:
    assert template_takes_tools(QwenStyleByteTokenizer()) and not template_takes_tools(ByteTokenizer())
    history = (ChatMessage("user", "Weather?"), ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_weather", '{"unit": "c", "days": 2}'),)),
               ChatMessage("tool", "sunny", tool_call_id="c1"))
    text = QwenStyleByteTokenizer().apply_chat_template(chat_messages(history, TOOLS, True), tools=template_tools(TOOLS))
    assert '"name": "get_weather", "description": "Weather forecast"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_template_without_tools_gets_them_in_the_system_prompt_and_calls_as_text() -> None:
    history = (ChatMessage("user", "Weather?"), ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_time", '{"zone": "utc"}'),)),
               ChatMessage("tool", "noon", tool_call_id="c1"))
    messages = chat_messages(history, TOOLS, False)
    assert messages[0]["role"] == "system" and '"name": "get_time"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nnoon\n</tool_response>"}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_tool_grammar_yields_a_valid_call_from_a_random_model(seed: int) -> None:
    binding = make_tiny_binding("qwen3", seed=seed, tokenizer=QwenStyleByteTokenizer())
    grammar = tool_grammar(TOOLS, required=True, parallel=False)
    compile_grammar(grammar, binding.tokenizer)
    prompt = encode_chat(binding.tokenizer, ASK, template_tools(TOOLS)).tokens
    result = Generation(binding, prompt, GenerationParams(max_tokens=120, grammar=grammar)).run()
    content, calls = split_tool_calls(result.text, TOOLS, "g")
    assert content == "" and len(calls) == 1 and result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_auto_tool_grammar_yields_text_or_valid_calls(seed: int) -> None:
    binding = make_tiny_binding("llama", seed=seed)
    prompt = make_prompt(8, seed=seed)
    result = Generation(binding, prompt, GenerationParams(max_tokens=60, grammar=tool_grammar(TOOLS, required=False, parallel=True))).run()
    content, calls = split_tool_calls(result.text, TOOLS, "g")
    if calls:
        assert content == "" and all(jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name]) is None for c in calls)
    else:
        assert result.text and not result.text.startswith(("<", "\n")), result.text


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    engine = LocalEngine(make_tiny_binding("qwen3", tokenizer=QwenStyleByteTokenizer()), None)
    with running(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB, max_body_bytes=1 << 20))) as url:
        yield url
    engine.close(30)


def valid_call(name: str, arguments: dict[str, Any]) -> None:
    jsonschema.validate(arguments, SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"])
def test_openai_tool_choice_gets_a_valid_call(base_url: str, choice: Any) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="m", messages=ASK, tools=OPENAI_TOOLS, tool_choice=choice, max_tokens=120)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        assert call.type == "function" and call.id
        valid_call(call.function.name, json.loads(call.function.arguments))
    if isinstance(choice, dict):
        assert {c.function.name for c in calls} == {"get_time"}  # type: ignore[union-attr]


def test_openai_streamed_tool_calls_arrive_as_delta_chunks(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=ASK, tools=OPENAI_TOOLS, tool_choice="required", max_tokens=120,
                                            parallel_tool_calls=False, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            deltas.extend(chunk.choices[0].delta.tool_calls)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls" and len(deltas) == 1 and deltas[0].index == 0
    valid_call(deltas[0].function.name, json.loads(deltas[0].function.arguments))  # type: ignore[union-attr, arg-type]


def test_anthropic_tool_choice_any_gets_tool_use_blocks(base_url: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    reply = client.messages.create(model="m", max_tokens=120, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and uses
    for block in uses:
        valid_call(block.name, block.input)


def test_anthropic_streamed_tool_use_carries_input_json_deltas(base_url: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    with client.messages.stream(model="m", max_tokens=120, messages=ASK, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and "input_json" in kinds and uses and {b.name for b in uses} == {"get_weather"}
    assert [b.type for b in final.content] == ["tool_use"] * len(uses)  # no empty text block first, as unstreamed
    for block in uses:
        valid_call(block.name, block.input)


@pytest.mark.parametrize("max_tokens", [6, 40])
def test_calls_cut_short_by_max_tokens_finish_with_length_and_no_markup(base_url: str, max_tokens: int) -> None:
    """(One byte a token) 6 cut the call inside its tag, 40 inside its JSON: the answer did not end
    by itself, and no `<tool_call>` text reaches the client."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="m", messages=ASK, tools=OPENAI_TOOLS, tool_choice="required", max_tokens=max_tokens)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    for call in choice.message.tool_calls or []:
        valid_call(call.function.name, json.loads(call.function.arguments))  # type: ignore[union-attr]
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(model="m", max_tokens=max_tokens, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})
    assert message.stop_reason == "max_tokens"
    assert not any(block.type == "text" and "<tool_call>" in block.text for block in message.content)


def test_a_function_without_parameters_is_called_with_no_arguments(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    bare: Any = [{"type": "function", "function": {"name": "get_now", "description": "The time now"}}]
    reply = client.chat.completions.create(model="m", messages=ASK, tools=bare, tool_choice="required", max_tokens=120)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls
    assert all(c.function.name == "get_now" and json.loads(c.function.arguments) == {} for c in calls)  # type: ignore[union-attr]
