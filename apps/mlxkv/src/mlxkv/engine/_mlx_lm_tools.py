"""Calls into mlx-lm's tool parsers (`mlx_lm.tool_parsers.<name>.parse_tool_call`), typed."""

from __future__ import annotations

import importlib
from typing import Any

Parsed = tuple[str, dict[str, Any]]


def parse(parser: str, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed | None:
    """The one call mlx-lm's `parser` reads in `text`, or None where it reads none."""
    calls = parse_all(parser, text, tools)
    return calls[0] if len(calls) == 1 else None


def parse_all(parser: str, text: str, tools: list[dict[str, Any]] | None = None) -> list[Parsed]:
    """The calls mlx-lm's `parser` reads in `text` (none where it raises: a call cut short)."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    try:
        out = module.parse_tool_call(text, tools)
    except (ValueError, KeyError, IndexError, SyntaxError):  # what its parsers raise on text that is no call
        return []
    calls = out if isinstance(out, list) else [out]
    return [(c["name"], c["arguments"]) for c in calls
            if isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)]
