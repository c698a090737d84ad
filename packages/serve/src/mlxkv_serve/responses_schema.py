"""OpenAI Responses requests -> `GenerateRequest`, with what the response echoes back."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxkv_serve import tool_fields
from mlxkv_serve.adapter_fields import selection
from mlxkv_serve.config import ServeConfig
from mlxkv_serve.engine import Constraint, GenerateRequest, Sampling, Tool, ToolChoice
from mlxkv_serve.errors import RequestError
from mlxkv_serve.fields import Fields
from mlxkv_serve.responses_items import Item, input_items, messages
from mlxkv_serve.speculative_field import speculation

# Tools OpenAI runs on its side: this server cannot, so they are left out of the prompt (and reported).
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                          "file_search", "computer_use_preview", "computer", "code_interpreter", "image_generation",
                          "mcp", "local_shell", "shell", "apply_patch", "custom", "tool_search"})
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_METADATA = 16
UNSUPPORTED = {"background": (None, False), "conversation": (None,), "prompt": (None,), "top_logprobs": (None, 0)}


@dataclass(frozen=True, slots=True)
class ToolSet:
    """The function tools offered (a namespace's flattened to 'namespace.function') and the hosted
    ones left out."""

    tools: tuple[Tool, ...] = ()
    namespaced: dict[tuple[str, str], str] = field(default_factory=dict)  # (namespace, function) -> flat name
    left_out: tuple[str, ...] = ()

    def split(self, flat: str) -> tuple[str | None, str]:
        """A called flat name as (namespace, function)."""
        for (namespace, name), known in self.namespaced.items():
            if known == flat:
                return namespace, name
        return None, flat


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    generate: GenerateRequest
    stream: bool
    store: bool
    items: tuple[Item, ...]  # this request's input items (normalized)
    tools: ToolSet
    echo: dict[str, Any]  # the request's settings, as the response object shows them


def previous_id(body: Any) -> str | None:
    value = Fields(body).string("previous_response_id")
    if value is not None and not value:
        raise RequestError(400, "'previous_response_id' must not be empty", "previous_response_id")
    return value


def parse_responses(body: Any, config: ServeConfig, history: Sequence[Item] = ()) -> ResponsesRequest:
    """`history`: the items of the conversation so far (a previous response's input and output)."""
    f = Fields(body)
    for name, no_ops in UNSUPPORTED.items():
        if f.body.get(name) not in no_ops:
            raise RequestError(400, f"'{name}' is not supported by this server", name)
    items = input_items(f.required("input"))
    instructions = f.string("instructions")
    tools = tool_set(f.body.get("tools"))
    choice, forced = _tool_choice(f.body.get("tool_choice"), tools)
    constraint = text_format(f.body.get("text"))
    tool_fields.only_one(constraint, bool(tools.tools) and choice != "none", "text.format")
    max_tokens = f.integer("max_output_tokens", None, 1, config.max_tokens_limit)
    sampling = Sampling(temperature=f.number("temperature", config.default_temperature, 0.0, 2.0),
                        top_p=f.number("top_p", config.default_top_p, 0.0, 1.0, low_open=True))
    parallel = f.boolean("parallel_tool_calls", True)
    generate = GenerateRequest(
        max_tokens=config.default_max_tokens if max_tokens is None else max_tokens, default_max_tokens=max_tokens is None,
        sampling=sampling, messages=messages([*history, *items], instructions, tools.namespaced), constraint=constraint,
        tools=tools.tools, tool_choice=choice, tool_name=forced, parallel_tool_calls=parallel, speculative=speculation(f.body),
        **_thinking(f.body.get("reasoning"), config.max_tokens_limit), **selection(f.body),
    )
    echo = {"instructions": instructions, "max_output_tokens": max_tokens, "metadata": _metadata(f.body.get("metadata")),
            "parallel_tool_calls": parallel, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "tool_choice": f.body.get("tool_choice") or "auto", "tools": _echo_tools(f.body.get("tools")),
            "text": {"format": (f.body.get("text") or {}).get("format") or {"type": "text"}},
            "reasoning": _reasoning(f.body.get("reasoning")), "truncation": _truncation(f),
            "user": f.string("user"), "prompt_cache_key": f.string("prompt_cache_key"), "service_tier": _tier(f)}
    _accepted(f)
    return ResponsesRequest(generate, f.boolean("stream", False), f.boolean("store", True), tuple(items), tools, echo)


def tool_set(raw: Any) -> ToolSet:
    if raw is None:
        return ToolSet()
    if not isinstance(raw, list):
        raise RequestError(400, "'tools' must be a list of tools", "tools")
    tools: list[Tool] = []
    namespaced: dict[tuple[str, str], str] = {}
    left_out: list[str] = []
    for i, entry in enumerate(raw):
        where = f"tools[{i}]"
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind == "function":
            tools.append(_function(entry, where))
        elif kind == "namespace":
            for name, tool in _namespace(entry, where):
                namespaced[name] = tool.name
                tools.append(tool)
        elif kind in HOSTED_TOOLS:
            left_out.append(str(kind))
        else:
            raise RequestError(400, f"'{where}.type' {kind!r} is not a tool type this server knows", f"{where}.type")
    return ToolSet(tool_fields.distinct(tools, "tools"), namespaced, tuple(left_out))


def _function(raw: dict[str, Any], where: str, prefix: str = "") -> Tool:
    if "function" in raw and "name" not in raw:
        raise RequestError(400, f"'{where}' is a chat-completions tool; the Responses API takes "
                           "{\"type\": \"function\", \"name\": ..., \"parameters\": {...}}", where)
    tool = tool_fields.tool(raw.get("name"), raw.get("description"), raw.get("parameters"), where)
    return Tool(prefix + tool.name, tool.description, tool.parameters)


def _namespace(raw: dict[str, Any], where: str) -> list[tuple[tuple[str, str], Tool]]:
    name, tools = raw.get("name"), raw.get("tools")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(400, f"'{where}.name' {name!r} must be 1-64 letters, digits, '_' or '-'", f"{where}.name")
    if raw.get("description") is not None and not isinstance(raw.get("description"), str):
        raise RequestError(400, f"'{where}.description' must be a string", f"{where}.description")
    if not isinstance(tools, list) or not tools:
        raise RequestError(400, f"'{where}.tools' must be a non-empty list of function tools", f"{where}.tools")
    out = []
    for j, entry in enumerate(tools):
        inner = f"{where}.tools[{j}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise RequestError(400, f"'{inner}' must be a function tool", inner)
        tool = _function(entry, inner, prefix=name + ".")
        out.append(((name, tool.name.removeprefix(name + ".")), tool))
    return out


def _tool_choice(raw: Any, tools: ToolSet) -> tuple[ToolChoice, str | None]:
    if raw is None or raw == "auto":
        return "auto", None
    if raw == "none":
        return "none", None
    if raw == "required":
        if not tools.tools:
            raise RequestError(400, "'tool_choice' 'required' needs function 'tools'", "tool_choice")
        return "required", None
    if isinstance(raw, dict) and raw.get("type") == "function":
        name, namespace = raw.get("name"), raw.get("namespace")
        flat = tools.namespaced.get((namespace, name), name) if isinstance(namespace, str) and isinstance(name, str) else name
        return "required", tool_fields.named_tool(flat, tools.tools, "tool_choice")
    raise RequestError(400, "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
                       "tool_choice")


def text_format(raw: Any) -> Constraint | None:
    """`text.format`: text, json_object or json_schema (the structured-output path)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError(400, "'text' must be an object", "text")
    spec = raw.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", '{"type":"object"}')
    if kind != "json_schema":
        raise RequestError(400, "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", "text.format")
    assert isinstance(spec, dict)
    if not isinstance(spec.get("name"), str) or not _NAME.fullmatch(spec["name"]):
        raise RequestError(400, "'text.format.name' must be 1-64 letters, digits, '_' or '-'", "text.format.name")
    if spec.get("schema") is None:
        raise RequestError(400, "'text.format.schema' is required for json_schema", "text.format.schema")
    return Constraint("json_schema", json.dumps(tool_fields.schema_object(spec["schema"], "text.format.schema")))


def _metadata(raw: Any) -> dict[str, str] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in raw.items()):
        raise RequestError(400, f"'metadata' must map at most {MAX_METADATA} keys (64 characters) to strings "
                           "(512 characters)", "metadata")
    return dict(raw)


def _reasoning(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {"effort": None, "summary": None}
    if not isinstance(raw, dict):
        raise RequestError(400, "'reasoning' must be an object", "reasoning")
    for name in ("effort", "summary", "generate_summary"):
        if raw.get(name) is not None and not isinstance(raw[name], str):
            raise RequestError(400, f"'reasoning.{name}' must be a string", f"reasoning.{name}")
    return {"effort": raw.get("effort"), "summary": raw.get("summary")}


def _thinking(raw: Any, limit: int) -> dict[str, Any]:
    """`reasoning.effort` "none" turns thinking off; `reasoning.max_tokens` (OpenRouter's spelling)
    closes the think section after that many tokens."""
    if not isinstance(raw, dict):
        return {}
    budget = raw.get("max_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= limit):
        raise RequestError(400, f"'reasoning.max_tokens' must be an integer in [0, {limit}], got {budget!r}", "reasoning.max_tokens")
    effort = raw.get("effort")
    return {"enable_thinking": False if effort == "none" else None, "thinking_budget": budget,
            "reasoning_effort": effort if isinstance(effort, str) and effort != "none" else None}


def _echo_tools(raw: Any) -> list[Any]:
    return list(raw) if isinstance(raw, list) else []


def _truncation(f: Fields) -> str:
    value = f.body.get("truncation") or "disabled"
    if value not in ("auto", "disabled"):
        raise RequestError(400, "'truncation' must be 'auto' or 'disabled'", "truncation")
    return str(value)


def _tier(f: Fields) -> str:
    value = f.string("service_tier")
    return "default" if value in (None, "auto") else str(value)


def _accepted(f: Fields) -> None:
    """Fields taken without effect here, type-checked so a wrong type is still a 400."""
    include = f.body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(s, str) for s in include)):
        raise RequestError(400, "'include' must be a list of strings", "include")
    for name in ("client_metadata", "stream_options"):
        if f.body.get(name) is not None and not isinstance(f.body[name], dict):
            raise RequestError(400, f"'{name}' must be an object", name)
    f.string("safety_identifier")
    f.string("prompt_cache_retention")
    f.integer("max_tool_calls", None, 1, 1_000_000)
