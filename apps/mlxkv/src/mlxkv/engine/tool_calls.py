"""Tool calling in the Hermes/Qwen format, on any model.

    answer := free text | <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call> (\\n<tool_call>...)*

A template that takes `tools` (Qwen, Hermes) renders them itself; for one that does not (the embedded
SmolLM2), the tools are described in the system prompt and past calls and results become text.
Either way the answer is constrained by a grammar whose calls name a declared tool with arguments
that match its schema; `required` (or a named tool) leaves out the free-text branch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxkv_inference import Grammar
from mlxkv_inference.generation.constraint import JSON_LAYOUT
from mlxkv_serve import ChatMessage, GenerateRequest, Tool, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How one request uses tools: the tools the model sees and whether its answer is constrained."""

    tools: tuple[Tool, ...]
    grammar: Grammar | None

    @property
    def active(self) -> bool:
        return self.grammar is not None


def tool_use(request: GenerateRequest) -> ToolUse:
    """The tools a request offers (none when `tool_choice` is "none") and its answer grammar."""
    if not request.tools or request.tool_choice == "none":
        return ToolUse((), None)
    callable_tools = [t for t in request.tools if request.tool_name in (None, t.name)]
    required = request.tool_choice == "required" or request.tool_name is not None
    return ToolUse(request.tools, tool_grammar(callable_tools, required=required, parallel=request.parallel_tool_calls))


def tool_grammar(tools: Sequence[Tool], *, required: bool, parallel: bool) -> Grammar:
    """A Lark grammar: text not starting with '<' (unless `required`), or calls of `tools`."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    lines = [
        "start: calls" if required else "start: TEXT | calls",
        'calls: call ("\\n" call)*' if parallel else "calls: call",
        f'call: "{OPEN}\\n" body "\\n{CLOSE}"',
        f"body: %json {json.dumps({'x-guidance': JSON_LAYOUT, 'anyOf': calls})}",
        r"TEXT: /[^<\n](.|\n)*/",
    ]
    return Grammar("lark", "\n".join(lines) + "\n")


class ToolAnswer:
    """Streams an answer that may be calls: free text is passed on as it comes (the grammar decides
    the branch on the first character), calls are held back until the answer is complete."""

    def __init__(self, tools: ToolUse, id_prefix: str) -> None:
        self._tools = tools
        self._id_prefix = id_prefix
        self._held = ""
        self._streaming = not tools.active

    def feed(self, text: str) -> str:
        """The part of `text` that can be sent now."""
        if self._streaming:
            return text
        self._held += text
        if self._held and not self._held.startswith("<"):  # the free-text branch: never a call
            self._streaming, text, self._held = True, self._held, ""
            return text
        return ""

    def finish(self, text: str) -> tuple[str, tuple[ToolCall, ...]]:
        """What is left to send of the whole answer `text`, and its calls."""
        if self._streaming:
            return "", ()
        return split_tool_calls(text, self._tools.tools, self._id_prefix)


def split_tool_calls(text: str, tools: Sequence[Tool], id_prefix: str) -> tuple[str, tuple[ToolCall, ...]]:
    """(text, calls) of an answer: one that starts with a call (the grammar's call branch) is
    calls only, its well-formed calls of declared tools; other text is returned whole.

    A call cut short (the answer ran out of tokens) is dropped, not returned as text: the markup is
    this format's, not the model's answer (the finish reason says the answer was cut).
    """
    if not text.startswith(OPEN) and not OPEN.startswith(text):  # (cut inside the first tag: a call too)
        return text, ()
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments"), dict):
            calls.append(ToolCall(f"{id_prefix}_{len(calls)}", call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    return "", tuple(calls)


def chat_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool], template_takes_tools: bool) -> list[dict[str, Any]]:
    """`messages` as chat-template input; without template support, tools and calls become text."""
    if template_takes_tools:
        return [_template_message(m) for m in messages]
    out = [_text_message(m) for m in messages]
    if tools:
        prompt = describe_tools(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """OpenAI function specs, as chat templates expect them."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": json.loads(t.parameters)}} for t in tools]


def describe_tools(tools: Sequence[Tool]) -> str:
    specs = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in template_tools(tools))
    return (f"You may call these tools:\n<tools>\n{specs}\n</tools>\nTo call one, answer with\n"
            f'{OPEN}\n{{"name": <tool name>, "arguments": <arguments object>}}\n{CLOSE}')


def _template_message(m: ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _text_message(m: ChatMessage) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
    calls = "\n".join(f"{OPEN}\n{json.dumps({'name': c.name, 'arguments': json.loads(c.arguments)})}\n{CLOSE}"
                      for c in m.tool_calls)
    return {"role": m.role, "content": "\n".join(part for part in (m.content, calls) if part)}
