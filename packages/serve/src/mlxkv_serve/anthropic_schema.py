"""Anthropic Messages requests -> `GenerateRequest`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxkv_serve.config import ServeConfig
from mlxkv_serve.engine import ChatMessage, GenerateRequest, Sampling
from mlxkv_serve.errors import RequestError
from mlxkv_serve.fields import Fields
from mlxkv_serve.unsupported import ANTHROPIC, refuse_unsupported

MAX_STOP = 16


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    generate: GenerateRequest
    stream: bool


def parse_messages(body: Any, config: ServeConfig) -> MessagesRequest:
    f = Fields(body)
    refuse_unsupported(f.body, ANTHROPIC)
    max_tokens = f.required("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= config.max_tokens_limit:
        raise RequestError(400, f"'max_tokens' must be an integer in [1, {config.max_tokens_limit}]", "max_tokens")
    raw = f.required("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    if messages[0].role != "user":
        raise RequestError(400, "the first message must have role 'user'", "messages")
    system = f.body.get("system")
    if system is not None:
        messages.insert(0, ChatMessage("system", _text(system, "system")))
    sampling = Sampling(
        temperature=f.number("temperature", config.default_temperature, 0.0, 1.0),
        top_p=f.number("top_p", config.default_top_p, 0.0, 1.0, low_open=True),
        top_k=int(f.integer("top_k", 0, 0, 1_000_000) or 0),
    )
    generate = GenerateRequest(max_tokens=max_tokens, sampling=sampling, messages=tuple(messages),
                               stop=f.stop("stop_sequences", MAX_STOP))
    return MessagesRequest(generate, f.boolean("stream", False))


def _message(raw: Any, index: int) -> ChatMessage:
    where = f"messages.{index}"
    if not isinstance(raw, dict):
        raise RequestError(400, f"{where}: must be an object")
    role = raw.get("role")
    if role not in ("user", "assistant"):
        raise RequestError(400, f"{where}.role: must be 'user' or 'assistant'")
    return ChatMessage(role, _text(raw.get("content"), f"{where}.content"))


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise RequestError(400, f"{where}: only text blocks are supported")
            parts.append(block["text"])
        return "".join(parts)
    raise RequestError(400, f"{where}: must be a string or a non-empty list of text blocks")
