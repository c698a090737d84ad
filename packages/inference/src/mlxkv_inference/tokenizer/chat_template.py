"""Render Hugging Face style Jinja chat templates in a sandbox."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxkv_inference.tokenizer.protocol import Message


def render_chat_template(
    template: str, messages: Sequence[Message], *, add_generation_prompt: bool, **extra: Any
) -> str:
    """Render `messages` with `template` as transformers' `apply_chat_template` does; a template
    that fails on them (a tool schema it cannot read) raises ValueError."""
    try:
        return _compile(template).render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **extra)
    except TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e


def _raise(message: str) -> NoReturn:
    raise ValueError(f"chat template error: {message}")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@lru_cache(maxsize=8)
def _compile(template: str) -> Template:
    # The globals and extension transformers gives templates (Mistral Small 3.x and gpt-oss date their system prompt).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)
