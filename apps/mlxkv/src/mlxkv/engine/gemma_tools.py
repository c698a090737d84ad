"""Gemma 4 tool calls: a JSON schema translated into the Lark rules of Gemma 4's argument syntax.

    <|tool_call>call:NAME{key:VALUE,key:VALUE}<tool_call|>
    VALUE := <|"|>text<|"|> | number | true | false | {key:VALUE,...} | [VALUE,...]

Keys are bare and come in sorted order (the template writes a past call's arguments through
`dictsort`); strings are delimited by the `<|"|>` token. A schema's strings (`enum`, `maxLength`),
integers (a small `minimum`..`maximum` range as its values), numbers, booleans, objects (their
declared properties, the required ones always) and arrays (`items`) are translated; any other
schema (`anyOf`, no `type`) allows any value. Parsing is mlx-lm's `gemma4` parser. A call's
results go back as the calling turn's `tool_responses`, as the template takes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from mlxkv_serve import Tool

MarkerLark = Callable[[str], str]
QUOTE = '<|"|>'
_SMALL_RANGE = 64  # an integer range up to this many values is written out as its values
_GENERIC = [
    'gvalue: gstr | NUMBER | "true" | "false" | "{" (KEY ":" gvalue ("," KEY ":" gvalue)*)? "}" | "[" (gvalue ("," gvalue)*)? "]"',
    r"KEY: /[A-Za-z_][A-Za-z0-9_]*/",
    # At most the digits a double or an int64 holds (and a finite exponent): a number cannot run on to max_tokens.
    r"NUMBER: /-?(0|[1-9][0-9]{0,16})(\.[0-9]{1,17})?([eE][+-]?[0-9]{1,2})?/",
    r"INT: /-?(0|[1-9][0-9]{0,17})/",
]


def gemma4_rules(literal: MarkerLark, tools: Sequence[Tool], parallel: bool) -> list[str]:
    """The Lark lines of the rule `calls`: one call (or several, `parallel`) of `tools`."""
    rules = _Rules(literal(QUOTE))
    names = [rules.add(f'{json.dumps("call:" + tool.name)} {rules.object(json.loads(tool.parameters))}') for tool in tools]
    call = f'call: {literal("<|tool_call>")} ({" | ".join(names)}) {literal("<tool_call|>")}'
    return ["calls: call+" if parallel else "calls: call", call, *rules.lines, *_GENERIC,
            f"gstr: {rules.quote} GTEXT {rules.quote}", r'GTEXT: /(.|\n)*/ & ~/(.|\n)*<\|"\|>(.|\n)*/']


class _Rules:
    """Collects the numbered rules a schema translates into."""

    def __init__(self, quote: str) -> None:
        self.quote = quote
        self.lines: list[str] = []

    def add(self, body: str, terminal: bool = False) -> str:
        name = f"{'GT' if terminal else 'g'}{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def value(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return "gvalue"
        kind = schema.get("type")
        if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]) and schema["enum"]:
            return "(" + " | ".join(f"{self.quote} {json.dumps(v)} {self.quote}" for v in schema["enum"]) + ")"
        if kind == "string":
            limit = schema.get("maxLength")
            body = self.add(f"/(.|\\n){{0,{limit}}}/ & ~/(.|\\n)*<\\|\"\\|>(.|\\n)*/", terminal=True) if isinstance(limit, int) else "GTEXT"
            return f"{self.quote} {body} {self.quote}"
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return "NUMBER"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "object":
            return self.add(self.object(schema))
        if kind == "array":
            return self.add(f'"[" {_items(self.value(schema.get("items")), schema.get("maxItems"))} "]"')
        return "gvalue"

    def object(self, schema: Any) -> str:
        """`{key:VALUE,...}` over the declared properties in sorted order, required ones always."""
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict):
            return '"{" (KEY ":" gvalue ("," KEY ":" gvalue)*)? "}"'
        listed = schema.get("required")
        required = {r for r in listed if isinstance(r, str)} if isinstance(listed, list) else set()
        items = [(self.add(f"{json.dumps(key + ':')} {self.value(properties[key])}"), key in required) for key in sorted(properties)]
        return f'"{{" {_separated(items)} "}}"' if items else '"{}"'

    def _integer(self, schema: dict[str, Any]) -> str:
        low, high = schema.get("minimum"), schema.get("maximum")
        if isinstance(low, int) and isinstance(high, int) and 0 <= high - low < _SMALL_RANGE:
            return "(" + " | ".join(f'"{n}"' for n in range(low, high + 1)) + ")"
        return "INT"


def gemma4_history(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat-template messages as Gemma 4's template takes a call's results: as `tool_responses` of
    the assistant turn that made the calls (`response:NAME{...}` right after them), not as turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        previous = out[-1] if out else None
        if message["role"] == "tool" and previous is not None and previous.get("tool_calls"):
            names = {c["id"]: c["function"]["name"] for c in previous["tool_calls"]}
            previous.setdefault("tool_responses", []).append(
                {"name": names.get(message.get("tool_call_id"), "unknown"), "response": _response(message["content"])})
            continue
        out.append(dict(message))
    return out


def _response(content: Any) -> Any:
    """A result as the template writes it: a JSON object's fields, else the text as `value`."""
    try:
        parsed = json.loads(content)
    except (TypeError, ValueError):
        return content
    return parsed if isinstance(parsed, dict) else content


def _items(item: str, most: Any) -> str:
    """Up to `most` comma-separated `item`s (any number where it is not a small integer)."""
    if not isinstance(most, int) or not 0 <= most <= _SMALL_RANGE:
        return f'({item} ("," {item})*)?'
    if most == 0:
        return ""
    rest = ""
    for _ in range(most - 1):  # built from the innermost: ("," item ("," item ...)?)?
        rest = f'("," {item} {rest})?'.replace(" )", ")")
    return f"({item} {rest})?".replace(" )", ")")


def _separated(items: Sequence[tuple[str, bool]]) -> str:
    """Comma-separated `items` in order, each optional one present or not: one alternative for
    each item that may come first (those before it optional)."""
    alternatives = []
    for i, (first, needed) in enumerate(items):
        rest = " ".join(f'"," {rule}' if must else f'("," {rule})?' for rule, must in items[i + 1:])
        alternatives.append(f"{first} {rest}".strip())
        if needed:  # a required item: none after it can come first
            return "(" + " | ".join(alternatives) + ")"
    return "(" + " | ".join(alternatives) + ")?"  # all optional: none at all too
