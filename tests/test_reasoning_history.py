"""An assistant turn's reasoning sent back by the client (OpenAI `reasoning_content`, Anthropic
`thinking` blocks, Responses `reasoning` items) reaches the real chat templates that show it: Qwen3's
within the current tool loop (so the next prompt holds the answer as the model wrote it: a cache
prefix), gpt-oss's as the analysis before a call."""

from __future__ import annotations

from typing import Any

import pytest

from mlxkv.engine.tool_calls import chat_messages, template_tools
from mlxkv.engine.tool_formats import model_tool_format
from mlxkv_serve import ChatMessage, ServeConfig, Tool, ToolCall
from mlxkv_serve.anthropic_schema import parse_messages
from mlxkv_serve.errors import RequestError
from mlxkv_serve.openai_schema import parse_chat
from mlxkv_serve.responses_schema import parse_responses
from tests.chat_templates import TemplateTokenizer

TOOLS = (Tool("get_weather", "Weather", '{"type": "object", "properties": {"unit": {"type": "string"}}}'),)
CALL = ToolCall("call_1", "get_weather", '{"unit": "c"}')
THOUGHT = "Check the weather."
HISTORY = (ChatMessage("user", "Weather?"), ChatMessage("assistant", "", tool_calls=(CALL,), reasoning=THOUGHT),
           ChatMessage("tool", "sunny", tool_call_id="call_1"))
CONFIG = ServeConfig(vocab_size=300)


def render(family: str, history: tuple[ChatMessage, ...], add_generation_prompt: bool = True) -> str:
    tokenizer = TemplateTokenizer(family)
    messages = chat_messages(history, TOOLS, True, model_tool_format(tokenizer))
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=template_tools(TOOLS))


def test_qwen3_shows_the_tool_loops_reasoning_so_the_next_prompt_extends_what_the_model_wrote() -> None:
    answer = f'<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {{"unit": "c"}}}}\n</tool_call>'
    assert render("qwen3", HISTORY).startswith(render("qwen3", HISTORY[:1]) + answer + "<|im_end|>\n")


def test_gpt_oss_shows_the_analysis_before_the_call() -> None:
    text = render("gpt_oss", HISTORY)
    assert (f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"unit": "c"}<|call|>') in text


def test_each_api_reads_the_reasoning_sent_back() -> None:
    call: Any = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}
    chat = parse_chat({"messages": [{"role": "user", "content": "Weather?"},
                                    {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [call]}]}, CONFIG)
    anthropic = parse_messages({"max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": "x"},
                                          {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"unit": "c"}}]}]}, CONFIG)
    responses = parse_responses({"input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": THOUGHT}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"unit": "c"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}, CONFIG)
    for request in (chat.generate, anthropic.generate, responses.generate):
        assert request.messages is not None
        assert [(m.role, m.reasoning) for m in request.messages][:2] == [("user", ""), ("assistant", THOUGHT)]


@pytest.mark.parametrize("value", [5, ["x"], {"text": "x"}])
def test_reasoning_content_that_is_not_text_is_a_400(value: object) -> None:
    with pytest.raises(RequestError) as refused:
        parse_chat({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a", "reasoning_content": value},
                                 {"role": "user", "content": "b"}]}, CONFIG)
    assert (refused.value.status, refused.value.param) == (400, "messages[1].reasoning_content")
