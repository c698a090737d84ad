"""Anthropic Messages requests -> `GenerateRequest`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxkv_serve.anthropic_thinking import Thinking, is_billing_header, thinking
from mlxkv_serve.config import ServeConfig
from mlxkv_serve import tool_fields
from mlxkv_serve.engine import ChatMessage, GenerateRequest, Sampling, Tool, ToolChoice
from mlxkv_serve.speculative_field import speculation
from mlxkv_serve.adapter_fields import selection
from mlxkv_serve.errors import RequestError
from mlxkv_serve.fields import Fields

MAX_STOP = 16
MEDIA = ("image", "document")
_CHOICES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    generate: GenerateRequest
    stream: bool
    thinking: Thinking | None = None
    billing_headers: int = 0  # Claude Code billing-header blocks left out of the prompt


def parse_messages(body: Any, config: ServeConfig, *, counting: bool = False) -> MessagesRequest:
    """A Messages request; `counting` (count_tokens) takes no `max_tokens` and nothing that only
    shapes the answer matters."""
    f = Fields(body)
    max_tokens = 1 if counting and f.body.get("max_tokens") is None else f.required("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= config.max_tokens_limit:
        raise RequestError(400, f"'max_tokens' must be an integer in [1, {config.max_tokens_limit}]", "max_tokens")
    think = thinking(f.body.get("thinking"), None if counting else max_tokens)
    raw = f.required("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    if not isinstance(raw[0], dict) or raw[0].get("role") != "user":
        raise RequestError(400, "the first message must have role 'user'", "messages")
    messages = [turn for i, m in enumerate(raw) for turn in _message(m, i)]
    if messages[0].role not in ("user", "tool"):
        raise RequestError(400, "the first message must have role 'user'", "messages")
    answer_start = ""
    if len(messages) > 1 and messages[-1].role == "assistant" and not messages[-1].tool_calls:
        answer_start = messages.pop().content  # a final assistant message: the answer continues it
    system, dropped = _system(f.body.get("system"), config.keep_billing_header)
    if system is not None:
        messages.insert(0, ChatMessage("system", system))
    sampling = Sampling(
        temperature=f.number("temperature", config.default_temperature, 0.0, 1.0),
        top_p=f.number("top_p", config.default_top_p, 0.0, 1.0, low_open=True),
        top_k=int(f.integer("top_k", 0, 0, 1_000_000) or 0),
    )
    tools, choice, name, parallel = _tools(f.body)
    constraint = tool_fields.extension(f.body)
    tool_fields.only_one(constraint, bool(tools) and choice != "none", "grammar" if "grammar" in f.body else "regex")
    if answer_start and (constraint is not None or (tools and choice != "none")):
        raise RequestError(400, "a final assistant message (the start of the answer) cannot be combined with tools, "
                           "a grammar or a regex here", "messages")
    generate = GenerateRequest(max_tokens=max_tokens, sampling=sampling, messages=tuple(messages), answer_start=answer_start,
                               stop=f.stop("stop_sequences", MAX_STOP), constraint=constraint, tools=tools,
                               tool_choice=choice, tool_name=name, parallel_tool_calls=parallel, speculative=speculation(f.body),
                               enable_thinking=None if think is None else think.kind != "disabled",
                               thinking_budget=think.budget if think is not None else None,
                               **selection(f.body))
    return MessagesRequest(generate, f.boolean("stream", False), think, dropped)


def _system(raw: Any, keep_billing_header: bool) -> tuple[str | None, int]:
    """The system prompt and how many billing-header blocks were left out of it."""
    if raw is None:
        return None, 0
    if isinstance(raw, list) and not keep_billing_header:
        kept = [block for block in raw if not is_billing_header(block)]
        if not kept:
            return None, len(raw)
        return _text(kept, "system"), len(raw) - len(kept)
    return _text(raw, "system"), 0


def _message(raw: Any, index: int) -> list[ChatMessage]:
    """One Anthropic message as chat turns: `tool_result` blocks become tool turns (before the
    text); an assistant's `thinking` blocks are its reasoning (templates show it or not);
    a `system` message inside the conversation (Claude Code sends them) stays a system turn."""
    where = f"messages.{index}"
    if not isinstance(raw, dict):
        raise RequestError(400, f"{where}: must be an object")
    role = raw.get("role")
    if role not in ("user", "assistant", "system"):
        raise RequestError(400, f"{where}.role: must be 'user', 'assistant' or 'system'")
    content = raw.get("content")
    if not isinstance(content, list):
        return [ChatMessage(role, _text(content, f"{where}.content"))]
    kinds = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
             "system": ("text",)}[role]
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in MEDIA:
            raise RequestError(400, f"{where}.content.{i}: this model reads text only; it cannot take {kind} blocks")
        if kind not in kinds:
            raise RequestError(400, f"{where}.content.{i}: a {role} message takes only {', '.join(kinds)} blocks")
    text = "".join(_text([b], f"{where}.content") for b in content if b["type"] == "text")
    if role == "system":
        return [ChatMessage("system", text)]
    if role == "assistant":
        calls = tuple(tool_fields.call(b.get("id"), b.get("name"), b.get("input"), f"{where}.content.{i}")
                      for i, b in enumerate(content) if b["type"] == "tool_use")
        thinking = "".join(b["thinking"] for b in content if b["type"] == "thinking" and isinstance(b.get("thinking"), str))
        return [ChatMessage("assistant", text, tool_calls=calls, reasoning=thinking)]
    results = [_tool_result(b, f"{where}.content.{i}") for i, b in enumerate(content) if b["type"] == "tool_result"]
    return results + ([ChatMessage("user", text)] if text or not results else [])


def _tool_result(block: dict[str, Any], where: str) -> ChatMessage:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise RequestError(400, f"{where}.tool_use_id: must be the id of the tool_use this answers")
    content = block.get("content")
    text = "" if content is None else _text(content, f"{where}.content")
    return ChatMessage("tool", f"Error: {text}" if block.get("is_error") is True else text, tool_call_id=call_id)


def _tools(body: dict[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice, str | None, bool]:
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise RequestError(400, "tools: must be a list of tools")
    tools = tool_fields.distinct([_tool(t, f"tools.{i}") for i, t in enumerate(raw or [])], "tools")
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto", None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise RequestError(400, "tool_choice: must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    assert isinstance(choice, dict)
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind in ("any", "tool") and not tools:
        raise RequestError(400, f"tool_choice: type '{kind}' needs 'tools'", "tool_choice")
    if kind == "tool":
        return tools, "required", tool_fields.named_tool(choice.get("name"), tools, "tool_choice.name"), parallel
    return tools, _CHOICES[kind], None, parallel


def _tool(raw: Any, where: str) -> Tool:
    if not isinstance(raw, dict):
        raise RequestError(400, f"{where}: must be an object")
    if raw.get("type") not in (None, "custom"):
        raise RequestError(400, f"{where}.type: only client tools ('custom', with an input_schema) are supported", where)
    if raw.get("input_schema") is None:
        raise RequestError(400, f"{where}.input_schema: Field required", where)
    return tool_fields.tool(raw.get("name"), raw.get("description"), raw.get("input_schema"), where)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in MEDIA:
                raise RequestError(400, f"{where}: this model reads text only; it cannot take {kind} blocks")
            if kind != "text" or not isinstance(block.get("text"), str):
                raise RequestError(400, f"{where}: only text blocks are supported")
            parts.append(block["text"])
        return "".join(parts)
    raise RequestError(400, f"{where}: must be a string or a non-empty list of text blocks")
