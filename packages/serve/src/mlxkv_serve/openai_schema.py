"""OpenAI chat and completions requests -> `GenerateRequest`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxkv_serve.config import ServeConfig
from mlxkv_serve.engine import ChatMessage, GenerateRequest, Sampling
from mlxkv_serve.errors import RequestError
from mlxkv_serve.fields import Fields
from mlxkv_serve.unsupported import OPENAI, refuse_unsupported

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4


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
        max_tokens = f.integer("max_tokens", config.default_max_tokens, 1, config.max_tokens_limit)
    return _request(f, config, max_tokens, top, messages=chat)


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
    max_tokens = f.integer("max_tokens", config.default_max_tokens, 1, config.max_tokens_limit)
    if f.body.get("echo"):
        raise RequestError(400, "'echo' is not supported", "echo")
    return _request(f, config, max_tokens, lp, prompt=text, prompt_tokens=tokens)


def _request(f: Fields, config: ServeConfig, max_tokens: int | None, top: int | None, **prompt: Any) -> OpenAiRequest:
    refuse_unsupported(f.body, OPENAI)
    if f.integer("n", 1, 1, 1_000_000) != 1:
        raise RequestError(400, "'n' must be 1: one choice per request", "n")
    options = f.body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage") is True)
    assert max_tokens is not None
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
    generate = GenerateRequest(max_tokens=max_tokens, sampling=sampling, stop=f.stop("stop", MAX_STOP), top_logprobs=top, **prompt)
    return OpenAiRequest(generate, f.boolean("stream", False), include_usage)


def _message(raw: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise RequestError(400, f"'{where}' must be an object", where)
    role = raw.get("role")
    if role not in ROLES:
        raise RequestError(400, f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
    return ChatMessage("system" if role == "developer" else role, content_text(raw.get("content"), f"{where}.content"))


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
