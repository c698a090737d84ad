"""Responses API input items: checked and normalized (the form a stored response keeps), then
turned into chat turns.

    input item                        chat turn
    message (system | developer)  ->  system
    message (user)                ->  user
    message (assistant)           ->  assistant (text)
    function_call (after it)      ->  the same assistant turn's tool calls
    function_call_output          ->  tool (answers a call made earlier in the conversation)
    reasoning                     ->  the reasoning of the assistant turn after it (its summary text)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from mlxkv_serve import tool_fields
from mlxkv_serve.engine import ChatMessage, ToolCall
from mlxkv_serve.errors import RequestError

Item = dict[str, Any]
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def input_items(raw: Any) -> list[Item]:
    """`input`: a string (one user message) or a list of items, normalized."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list):
        raise RequestError(400, "'input' must be a string or a list of items", "input")
    return [item(entry, f"input[{i}]") for i, entry in enumerate(raw)]


def item(raw: Any, where: str) -> Item:
    if not isinstance(raw, dict):
        raise RequestError(400, f"'{where}' must be an object", where)
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "message":
        return _message(raw, where)
    if kind == "function_call":
        call = tool_fields.call(raw.get("call_id"), raw.get("name"), raw.get("arguments"), where)
        namespace = raw.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise RequestError(400, f"'{where}.namespace' must be a string", f"{where}.namespace")
        out = {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": call.arguments}
        return out | ({"namespace": namespace} if namespace else {})
    if kind == "function_call_output":
        call_id = raw.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise RequestError(400, f"'{where}.call_id' must be the call_id of the function_call it answers", f"{where}.call_id")
        return {"type": "function_call_output", "call_id": call_id, "output": _output_text(raw.get("output"), f"{where}.output")}
    if kind == "reasoning":
        return _reasoning(raw, where)
    raise RequestError(400, f"'{where}.type' {kind!r} is not supported; items may be {', '.join(ITEM_TYPES)}", f"{where}.type")


def messages(items: Sequence[Item], instructions: str | None, namespaced: Mapping[tuple[str, str], str]) -> tuple[ChatMessage, ...]:
    """The chat turns of a conversation's items; a `function_call_output` must answer an earlier call.

    `namespaced`: (namespace, function) -> the flat name the prompt offers it under."""
    turns: list[ChatMessage] = [ChatMessage("system", instructions)] if instructions else []
    calls: set[str] = set()
    reasoning = ""  # reasoning items' text, for the assistant turn that follows them
    for i, entry in enumerate(items):
        kind = entry["type"]
        if kind == "reasoning":
            reasoning += "".join(part["text"] for part in entry["summary"])
        elif kind == "message":
            role = ROLES[entry["role"]]
            mine = reasoning if role == "assistant" else ""
            turns.append(ChatMessage(role, "".join(p["text"] for p in entry["content"]), reasoning=mine))  # type: ignore[arg-type]
            reasoning = reasoning if role != "assistant" else ""
        elif kind == "function_call":
            name = namespaced.get((entry.get("namespace", ""), entry["name"]), entry["name"])
            call = ToolCall(entry["call_id"], name, entry["arguments"])
            calls.add(call.id)
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant" and _open(items, i):
                turns[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                turns.append(ChatMessage("assistant", "", tool_calls=(call,), reasoning=reasoning))
                reasoning = ""
        elif kind == "function_call_output":
            if entry["call_id"] not in calls:
                raise RequestError(400, f"'input' has a function_call_output for call_id {entry['call_id']!r}, but no "
                                   "function_call with that call_id comes before it", "input")
            turns.append(ChatMessage("tool", entry["output"], tool_call_id=entry["call_id"]))
    if not turns:
        raise RequestError(400, "'input' holds no message to answer", "input")
    return tuple(turns)


def _open(items: Sequence[Item], index: int) -> bool:
    """Whether the item before `index` is part of the same assistant turn (its message or a call)."""
    before = items[index - 1] if index else None
    return before is not None and (before["type"] == "function_call" or
                                   (before["type"] == "message" and before["role"] == "assistant"))


def _message(raw: dict[str, Any], where: str) -> Item:
    role = raw.get("role")
    if role not in ROLES:
        raise RequestError(400, f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
    content = raw.get("content")
    if isinstance(content, str):
        parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    elif isinstance(content, list):
        parts = [_part(p, f"{where}.content[{i}]") for i, p in enumerate(content)]
    else:
        raise RequestError(400, f"'{where}.content' must be a string or a list of text parts", f"{where}.content")
    return {"type": "message", "role": role, "content": parts}


def _part(raw: Any, where: str) -> dict[str, str]:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "refusal" and isinstance(raw.get("refusal"), str):
        return {"type": "output_text", "text": raw["refusal"]}
    if kind not in TEXT_PARTS or not isinstance(raw.get("text"), str):
        hint = " (this model reads text only)" if kind in ("input_image", "input_file", "input_audio") else ""
        raise RequestError(400, f"'{where}' must be a text part ({', '.join(TEXT_PARTS)} with a string 'text'){hint}", where)
    return {"type": kind, "text": raw["text"]}


def _output_text(raw: Any, where: str) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        return "".join(_part(p, f"{where}[{i}]")["text"] for i, p in enumerate(raw))
    raise RequestError(400, f"'{where}' must be a string or a list of text parts", where)


def _reasoning(raw: dict[str, Any], where: str) -> Item:
    summary = raw.get("summary", [])
    if not isinstance(summary, list) or not all(isinstance(s, dict) and isinstance(s.get("text"), str) for s in summary):
        raise RequestError(400, f"'{where}.summary' must be a list of {{\"type\": \"summary_text\", \"text\": ...}}", f"{where}.summary")
    out: Item = {"type": "reasoning", "summary": [{"type": "summary_text", "text": s["text"]} for s in summary]}
    if raw.get("id") is not None:
        out["id"] = str(raw["id"])
    return out

