"""Tools and structured output in requests, checked the same way for both APIs: a 400 naming the
field for a bad tool name, a schema that is not an object, a tool choice naming no declared tool."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from mlxkv_serve.engine import Constraint, Tool, ToolCall
from mlxkv_serve.errors import RequestError

# Both OpenAI and Anthropic allow these names (letters, digits, '_' and '-', 1 to 64 characters).
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(400, f"'{where}' name {name!r} must be 1-64 letters, digits, '_' or '-'", where)
    if description is not None and not isinstance(description, str):
        raise RequestError(400, f"'{where}' description must be a string", where)
    # OpenAI: a function without `parameters` takes none (its arguments are `{}`), not any object.
    schema = NO_PARAMETERS if parameters is None else schema_object(parameters, where)
    return Tool(name, description or "", json.dumps(schema))


def distinct(tools: Sequence[Tool], where: str) -> tuple[Tool, ...]:
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RequestError(400, f"'{where}' declares {', '.join(duplicates)} more than once", where)
    return tuple(tools)


def named_tool(name: Any, tools: Sequence[Tool], where: str) -> str:
    """The declared tool a tool choice names."""
    if not any(t.name == name for t in tools):
        declared = ", ".join(t.name for t in tools) or "none"
        raise RequestError(400, f"'{where}' names tool {name!r}, which is not declared (declared: {declared})", where)
    assert isinstance(name, str)
    return name


def schema_object(schema: Any, where: str) -> dict[str, Any]:
    """A JSON schema: an object (absent means any object)."""
    if schema is None:
        return {"type": "object"}
    if not isinstance(schema, dict):
        raise RequestError(400, f"'{where}' schema must be a JSON schema object", where)
    return schema


def call(call_id: Any, name: Any, arguments: Any, where: str) -> ToolCall:
    """A past call in the history; `arguments` is a JSON object (or its text)."""
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise RequestError(400, f"'{where}' needs a string id and name", where)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise RequestError(400, f"'{where}' arguments must be a JSON object", where) from None
    if not isinstance(arguments, dict):
        raise RequestError(400, f"'{where}' arguments must be a JSON object", where)
    return ToolCall(call_id, name, json.dumps(arguments, ensure_ascii=False))


def extension(body: dict[str, Any]) -> Constraint | None:
    """The mlxkv extensions `grammar` (Lark, as llguidance accepts it) and `regex`."""
    found = [(kind, body.get(name)) for name, kind in (("grammar", "lark"), ("regex", "regex")) if body.get(name) is not None]
    if len(found) > 1:
        raise RequestError(400, "send at most one of 'grammar' and 'regex'", "grammar")
    if not found:
        return None
    kind, source = found[0]
    name = "grammar" if kind == "lark" else "regex"
    if not isinstance(source, str) or not source:
        raise RequestError(400, f"'{name}' must be a non-empty string", name)
    return Constraint("lark" if kind == "lark" else "regex", source)


def only_one(constraint: Constraint | None, tools_active: bool, where: str) -> None:
    if constraint is not None and tools_active:
        raise RequestError(400, f"'{where}' cannot be combined with tools the model may call; send one", where)
