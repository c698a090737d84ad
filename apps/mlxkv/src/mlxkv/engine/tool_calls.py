"""Tool calling on any model, in the call format of its family (see `tool_formats`).

    answer := [think section] (free text | calls)            calls: the family's format

A template that takes `tools` (Qwen, Hermes, Llama 3.x, Mistral) renders them itself and its
family's format is used; for one that does not (the embedded SmolLM2), the tools are described in
the system prompt in the Hermes format and past calls and results become text. Either way the
answer is constrained by a grammar whose calls name a declared tool with arguments that match its
schema; `required` (or a named tool) leaves out the free-text branch. A reasoning model's think
section may come first (see `thinking.ThinkPlan`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mlxkv_inference import Grammar
from mlxkv_serve import ChatMessage, Constraint, GenerateRequest, Tool, ToolCall

from mlxkv.engine.gemma_tools import gemma4_history
from mlxkv.engine.harmony import harmony_grammar, harmony_history, json_rule, regex_rule
from mlxkv.engine.thinking import ThinkPlan, think_rules
from mlxkv.engine.tool_formats import ToolFormat, hermes_format

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How one request uses tools: the tools the model sees, those it may call, and in what format."""

    tools: tuple[Tool, ...]
    callable: tuple[Tool, ...] = ()
    required: bool = False
    parallel: bool = True
    format: ToolFormat = field(default_factory=hermes_format)

    @property
    def active(self) -> bool:
        """Whether the answer is constrained to text or calls."""
        return bool(self.callable)

    def grammar(self, think: ThinkPlan | None = None) -> Grammar:
        """The answer's grammar: the think section where `think` says, then text or calls."""
        return tool_grammar(self.callable, required=self.required, parallel=self.parallel, fmt=self.format, think=think)


def tool_use(request: GenerateRequest, fmt: ToolFormat | None = None) -> ToolUse:
    """The tools a request offers (none when `tool_choice` is "none"), in the model's format `fmt`."""
    if not request.tools or request.tool_choice == "none":
        return ToolUse((), format=fmt or hermes_format())  # the format still says how the answer is read
    callable_tools = tuple(t for t in request.tools if request.tool_name in (None, t.name))
    required = request.tool_choice == "required" or request.tool_name is not None
    return ToolUse(request.tools, callable_tools, required, request.parallel_tool_calls, fmt or hermes_format())


def tool_grammar(tools: Sequence[Tool], *, required: bool, parallel: bool, fmt: ToolFormat | None = None,
                 think: ThinkPlan | None = None) -> Grammar:
    """A Lark grammar: [think section] then text not starting as a call does (unless `required`), or calls of `tools`."""
    fmt = fmt or hermes_format()
    if fmt.name == "harmony":  # channels, not a think section: its analysis is unbounded here
        return harmony_grammar(tools, required=required, budget=None, literal=fmt.literal)
    answer = "calls" if required else "TEXT | calls"
    lines = [_start(answer, think), *think_rules(think, newlines=True), *fmt.rules(tools, parallel), fmt.text_rule()]
    return Grammar("lark", "\n".join(lines) + "\n")


def think_grammar(think: ThinkPlan) -> Grammar:
    """The think section (within its budget), then any text: for an answer with no other grammar."""
    lines = [_start("ANY", think), *think_rules(think, newlines=False), r"ANY: /(.|\n)*/"]
    return Grammar("lark", "\n".join(lines) + "\n")


def constrained_grammar(constraint: Constraint, think: ThinkPlan | None) -> Grammar:
    """The user's constraint, after the think section (within its budget) where `think` says. A Lark
    grammar is applied alone (its own `start` cannot be nested): a think section is its to allow."""
    if think is None or constraint.kind == "lark":
        return Grammar(constraint.kind, constraint.source)
    answer = json_rule(json.loads(constraint.source)) if constraint.kind == "json_schema" else regex_rule(constraint.source)
    lines = [_start("answer", think), *think_rules(think, newlines=constraint.kind == "json_schema"), f"answer: {answer}"]
    return Grammar("lark", "\n".join(lines) + "\n")


def _start(answer: str, think: ThinkPlan | None) -> str:
    if think is None:
        return f"start: {answer}"
    return f"start: think ({answer})" if think.opened else f"start: think? ({answer})"


class ToolAnswer:
    """Streams an answer that may be calls: free text is passed on as it comes (the grammar decides
    the branch on its first characters), calls are held back until the answer is complete."""

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
        start = self._tools.format.start
        if self._held and not self._held.startswith(start) and not start.startswith(self._held):  # never a call
            self._streaming, text, self._held = True, self._held, ""
            return text
        return ""

    def finish(self, text: str) -> tuple[str, tuple[ToolCall, ...]]:
        """What is left to send of the whole answer `text`, and its calls."""
        if self._streaming:
            return "", ()
        return split_tool_calls(text, self._tools.tools, self._id_prefix, self._tools.format)


def split_tool_calls(text: str, tools: Sequence[Tool], id_prefix: str,
                     fmt: ToolFormat | None = None) -> tuple[str, tuple[ToolCall, ...]]:
    """(text, calls) of an answer: one that starts with a call (the grammar's call branch) is
    calls only, its well-formed calls of declared tools; other text is returned whole.

    A call cut short (the answer ran out of tokens) is dropped, not returned as text: the markup is
    this format's, not the model's answer (the finish reason says the answer was cut).
    """
    fmt = fmt or hermes_format()
    cut_in_marker = not fmt.start_is_token and fmt.start.startswith(text)  # a call cut inside its spelled-out marker
    if not text.startswith(fmt.start) and not cut_in_marker:
        return text, ()
    names = {t.name for t in tools}
    calls = [(name, arguments) for name, arguments in fmt.parse(text, tools) if name in names]
    return "", tuple(ToolCall(f"{id_prefix}_{i}", name, json.dumps(arguments, ensure_ascii=False))
                     for i, (name, arguments) in enumerate(calls))


def chat_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool], template_takes_tools: bool,
                  fmt: ToolFormat | None = None) -> list[dict[str, Any]]:
    """`messages` as chat-template input, in the form `fmt`'s family takes its history (see
    `family_history`); without template support, tools and calls become text."""
    if template_takes_tools:
        out = [_template_message(m) for m in (family_history(messages, fmt) if fmt is not None else messages)]
        return gemma4_history(out) if fmt is not None and fmt.name == "gemma4" else out
    out = [_text_message(m) for m in messages]
    if tools:
        prompt = describe_tools(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def family_history(messages: Sequence[ChatMessage], fmt: ToolFormat) -> Sequence[ChatMessage]:
    """`messages` as the family's template takes them: gpt-oss one call a turn (see `harmony_history`);
    Mistral call ids of 9 letters and digits (its templates refuse others; vLLM maps them too)."""
    if fmt.name == "harmony":
        return harmony_history(messages)
    if fmt.name.startswith("mistral"):
        return [replace(m, tool_calls=tuple(replace(c, id=_nine_chars(c.id)) for c in m.tool_calls),
                        tool_call_id=None if m.tool_call_id is None else _nine_chars(m.tool_call_id)) for m in messages]
    return messages


def _nine_chars(call_id: str) -> str:
    """A client's call id as a Mistral id: kept when it is one, else a digest of it (the same id
    maps alike in the call and its result, and in every turn, so the prompt stays a cache prefix)."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


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
    if m.reasoning:  # Qwen3's templates read `reasoning_content`, gpt-oss's `thinking` (not beside content with calls)
        message["reasoning_content"] = m.reasoning
        if not (m.tool_calls and m.content):
            message["thinking"] = m.reasoning
    return message


def _text_message(m: ChatMessage) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
    calls = "\n".join(f"{OPEN}\n{json.dumps({'name': c.name, 'arguments': json.loads(c.arguments)})}\n{CLOSE}"
                      for c in m.tool_calls)
    return {"role": m.role, "content": "\n".join(part for part in (m.content, calls) if part)}
