"""Fields that change what an answer must look like (tools, structured output), which mlxkv cannot
honour yet: refused with a 400 naming the field rather than silently dropped. The no-op forms
(no tools, `tool_choice` that calls none, plain-text format) are accepted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxkv_serve.errors import RequestError

OPENAI: Mapping[str, tuple[Any, ...]] = {
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
}
ANTHROPIC: Mapping[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ({"type": "auto"}, {"type": "none"}),
}


def refuse_unsupported(body: Mapping[str, Any], accepted: Mapping[str, tuple[Any, ...]]) -> None:
    for name, no_ops in accepted.items():
        value = body.get(name)
        if value is not None and value not in no_ops:
            shown = " or ".join(repr(v) for v in no_ops)
            raise RequestError(400, f"'{name}' is not supported yet (tool calls and structured output are not "
                               f"implemented); omit it, or send {shown}", name)
