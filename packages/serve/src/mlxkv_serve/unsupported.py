"""OpenAI's deprecated `functions` / `function_call` fields: refused with a 400 naming the field
(use `tools` / `tool_choice`) rather than silently dropped. The no-op forms are accepted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxkv_serve.errors import RequestError

OPENAI: Mapping[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none", "auto"),
}


def refuse_unsupported(body: Mapping[str, Any], accepted: Mapping[str, tuple[Any, ...]]) -> None:
    for name, no_ops in accepted.items():
        value = body.get(name)
        if value is not None and value not in no_ops:
            shown = " or ".join(repr(v) for v in no_ops)
            raise RequestError(400, f"'{name}' is not supported (deprecated by OpenAI): send 'tools' and 'tool_choice' "
                               f"instead, or {shown}", name)
