"""The response builder's events for a reasoning model's answer with a namespaced call, read with
the openai SDK's own event and response types. Model-free: the engine events are fed directly."""

from __future__ import annotations

from typing import Any

import pydantic
from openai.types.responses import Response, ResponseStreamEvent

from mlxkv_serve.engine import Delta, Finished, Tool, ToolCall
from mlxkv_serve.responses_schema import ToolSet
from mlxkv_serve.responses_stream import ResponseBuilder, ResponseIds

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
ECHO: dict[str, Any] = {"instructions": None, "max_output_tokens": None, "metadata": None, "parallel_tool_calls": True, "temperature": 0.0,
        "top_p": 1.0, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
        "reasoning": {"effort": None, "summary": None}, "truncation": "disabled", "user": None, "prompt_cache_key": None,
        "service_tier": "default"}


def finished(reason: str, calls: tuple[ToolCall, ...] = ()) -> Finished:
    return Finished(reason, None, prompt_tokens=100, completion_tokens=7, cached_tokens=90, seed=1,  # type: ignore[arg-type]
                    generation_id="g", ttft_s=0.1, tool_calls=calls)


def builder() -> ResponseBuilder:
    tools = ToolSet((Tool("agents.spawn", "", "{}"),), {("agents", "spawn"): "agents.spawn"})
    return ResponseBuilder(ResponseIds("resp_" + "a" * 32, 1, "m", None, True), ECHO, tools)


def test_thinking_then_text_then_a_namespaced_call_is_the_documented_sequence() -> None:
    b = builder()
    events = b.start()
    for delta in (Delta("", reasoning="Let me "), Delta("", reasoning="think."), Delta("Hi"), Delta(" there")):
        events += b.delta(delta)
    events += b.finish(finished("tool_calls", (ToolCall("call_1", "agents.spawn", "{}"),)))
    parsed = [EVENTS.validate_python(e) for e in events]
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    final = Response.model_validate(b.response())
    reasoning, message, call = final.output
    assert reasoning.type == "reasoning" and reasoning.summary[0].text == "Let me think."
    assert message.type == "message" and final.output_text == "Hi there"
    assert call.type == "function_call" and (call.name, call.namespace, call.call_id) == ("spawn", "agents", "call_1")
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 2
    assert final.usage.input_tokens_details.cached_tokens == 90 and final.status == "completed"


def test_length_is_incomplete_for_max_output_tokens() -> None:
    b = builder()
    b.start()
    b.delta(Delta("Hi"))
    last = EVENTS.validate_python(b.finish(finished("length"))[-1])
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
