"""OpenAI chat and completions requests -> `GenerateRequest`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mlxkv_serve.config import ServeConfig
from mlxkv_serve import tool_fields
from mlxkv_serve.engine import ChatMessage, Constraint, GenerateRequest, Sampling, Tool, ToolCall, ToolChoice
from mlxkv_serve.speculative_field import speculation
from mlxkv_serve.adapter_fields import selection
from mlxkv_serve.errors import RequestError
from mlxkv_serve.fields import Fields
from mlxkv_serve.unsupported import OPENAI, refuse_unsupported

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class OpenAiRequest:
    generate: GenerateRequest
    stream: bool
    include_usage: bool


def parse_chat(body: Any, config: ServeConfig) -> OpenAiRequest:
    f = Fields(body)
    messages = f.required("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    chat = tuple(_message(m, i) for i, m in enumerate(messages))
    top: int | None = None
    if f.boolean("logprobs", False):
        top = f.integer("top_logprobs", 0, 0, 20)
    elif f.body.get("top_logprobs") is not None:
        raise RequestError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens = f.integer("max_completion_tokens", None, 1, config.max_tokens_limit)
    if max_tokens is None:
        max_tokens = f.integer("max_tokens", None, 1, config.max_tokens_limit)
    # vLLM's `thinking_token_budget`: the think section is closed after that many tokens (0: none).
    budget = f.integer("thinking_token_budget", None, 0, config.max_tokens_limit)
    effort = f.string("reasoning_effort")
    return _request(f, config, max_tokens, top, messages=chat, enable_thinking=_enable_thinking(f.body), thinking_budget=budget,
                    reasoning_effort=None if effort == "none" else effort)


def _enable_thinking(body: Any) -> bool | None:
    """`chat_template_kwargs.enable_thinking` (vLLM's and SGLang's field; DeepSeek's `thinking` too),
    else off for `reasoning_effort` "none"; the template's other keyword arguments are not passed on."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return False if body.get("reasoning_effort") == "none" else None  # OpenAI's effort "none": no reasoning
    if not isinstance(kwargs, dict):
        raise RequestError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    value = kwargs.get("enable_thinking", kwargs.get("thinking"))
    if value is not None and not isinstance(value, bool):
        raise RequestError(400, f"'chat_template_kwargs.enable_thinking' must be true or false, got {value!r}",
                           "chat_template_kwargs")
    return value


def parse_completion(body: Any, config: ServeConfig) -> OpenAiRequest:
    f = Fields(body)
    prompt = f.required("prompt")
    text: str | None = None
    tokens: tuple[int, ...] | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(400, "'prompt' must not be empty", "prompt")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        tokens = tuple(prompt)
    else:
        raise RequestError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    lp = f.integer("logprobs", None, 0, 5)
    max_tokens = f.integer("max_tokens", None, 1, config.max_tokens_limit)
    if f.body.get("tools") or f.body.get("tool_choice") is not None:
        raise RequestError(400, "tools are for /v1/chat/completions; a completion has no chat template to offer them", "tools")
    if f.body.get("echo"):
        raise RequestError(400, "'echo' is not supported", "echo")
    return _request(f, config, max_tokens, lp, prompt=text, prompt_tokens=tokens)


def _request(f: Fields, config: ServeConfig, max_tokens: int | None, top: int | None, **prompt: Any) -> OpenAiRequest:
    """`max_tokens` None: the client gave none (the server's default, within the context)."""
    refuse_unsupported(f.body, OPENAI)
    if f.integer("n", 1, 1, 1_000_000) != 1:
        raise RequestError(400, "'n' must be 1: one choice per request", "n")
    options = f.body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage") is True)
    sampling = Sampling(
        temperature=f.number("temperature", config.default_temperature, 0.0, 2.0),
        top_p=f.number("top_p", config.default_top_p, 0.0, 1.0, low_open=True),
        top_k=int(f.integer("top_k", 0, 0, 1_000_000) or 0),
        min_p=f.number("min_p", 0.0, 0.0, 1.0),
        repetition_penalty=f.number("repetition_penalty", 1.0, 0.0, 10.0, low_open=True),
        presence_penalty=f.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=f.logit_bias("logit_bias", config.vocab_size),
        seed=f.integer("seed", None, 0, 2**63 - 1),
    )
    tools, choice, name = _tools(f.body)
    formatted, extension = _response_format(f.body.get("response_format")), tool_fields.extension(f.body)
    if formatted is not None and extension is not None:
        raise RequestError(400, "send one of 'response_format' and 'grammar' / 'regex': both constrain the answer",
                           "response_format")
    constraint = formatted or extension
    tool_fields.only_one(constraint, bool(tools) and choice != "none", "response_format")
    generate = GenerateRequest(max_tokens=config.default_max_tokens if max_tokens is None else max_tokens,
                               default_max_tokens=max_tokens is None, sampling=sampling, stop=f.stop("stop", MAX_STOP), top_logprobs=top,
                               constraint=constraint, tools=tools, tool_choice=choice, tool_name=name,
                               parallel_tool_calls=f.boolean("parallel_tool_calls", True),
                               speculative=speculation(f.body), **prompt, **selection(f.body))
    return OpenAiRequest(generate, f.boolean("stream", False), include_usage)


def _message(raw: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise RequestError(400, f"'{where}' must be an object", where)
    role = raw.get("role")
    if role not in ROLES:
        raise RequestError(400, f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
    if raw.get("content") is None and role != "assistant":  # only an assistant's (tool calls) may go without
        raise RequestError(400, f"'{where}.content' is required for a {role} message", f"{where}.content")
    content = content_text(raw.get("content"), f"{where}.content")
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str):
            raise RequestError(400, f"'{where}.tool_call_id' must be the id of the call this answers", f"{where}.tool_call_id")
        return ChatMessage("tool", content, tool_call_id=call_id)
    if role != "assistant":
        return ChatMessage("system" if role == "developer" else role, content)
    calls = raw.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise RequestError(400, f"'{where}.tool_calls' must be a list", f"{where}.tool_calls")
    return ChatMessage("assistant", content, tool_calls=tuple(_past_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls or ())),
                       reasoning=_reasoning(raw, where))


def _reasoning(raw: dict[str, Any], where: str) -> str:
    """An assistant turn's `reasoning_content` sent back (vLLM's `reasoning` too)."""
    for name in ("reasoning_content", "reasoning"):
        value = raw.get(name)
        if value is not None and not isinstance(value, str):
            raise RequestError(400, f"'{where}.{name}' must be a string", f"{where}.{name}")
        if value:
            return value
    return ""


def _past_call(raw: Any, where: str) -> ToolCall:
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(function, dict):
        raise RequestError(400, f"'{where}' must be {{\"id\", \"type\": \"function\", \"function\": {{name, arguments}}}}", where)
    return tool_fields.call(raw.get("id"), function.get("name"), function.get("arguments"), where)


def _tools(body: dict[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice, str | None]:
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise RequestError(400, "'tools' must be a list of function tools", "tools")
    tools = tool_fields.distinct([_tool(t, f"tools[{i}]") for i, t in enumerate(raw or [])], "tools")
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto", None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise RequestError(400, "'tool_choice' must be 'auto', 'none', 'required' or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        return tools, "required", tool_fields.named_tool(function.get("name"), tools, "tool_choice")
    if choice not in ("auto", "none", "required"):
        raise RequestError(400, "'tool_choice' must be 'auto', 'none', 'required' or a named function", "tool_choice")
    if choice == "required" and not tools:
        raise RequestError(400, "'tool_choice' 'required' needs 'tools'", "tool_choice")
    return tools, choice, None


def _tool(raw: Any, where: str) -> Tool:
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(function, dict):
        raise RequestError(400, f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
    return tool_fields.tool(function.get("name"), function.get("description"), function.get("parameters"), where)


def _response_format(raw: Any) -> Constraint | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", '{"type":"object"}')
    spec = raw.get("json_schema") if kind == "json_schema" else None
    if not isinstance(spec, dict):
        raise RequestError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}", "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(400, "'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'",
                           "response_format.json_schema.name")
    schema = tool_fields.schema_object(spec.get("schema"), "response_format.json_schema.schema")
    return Constraint("json_schema", json.dumps(schema))


def content_text(content: Any, where: str) -> str:
    """A message content: a string, or a list of text parts (joined); other part types are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"'{where}' parts must be text parts ({{\"type\": \"text\", \"text\": ...}})", where)
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(400, f"'{where}' must be a string or a list of text parts", where)
