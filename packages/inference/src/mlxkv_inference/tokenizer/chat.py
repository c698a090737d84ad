"""Chat prompts as token ids, with the end of the templated history marked.

    [ templated history .......... | generation prompt ]
                                   ^ history_end: the boundary the prompt cache snapshots, so the
                                     next turn (whose prompt renders this history again) hits
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxkv_inference.tokenizer.protocol import Message, Tokenizer


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    tokens: list[int]
    history_end: int | None  # None when the history is not a token prefix of the prompt


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Message], tools: Sequence[Message] | None = None,
                answer_start: str = "", enable_thinking: bool | None = None, reasoning_effort: str | None = None) -> ChatPrompt:
    """`answer_start`: text the answer begins with (after the generation prompt), for the model to
    continue; `enable_thinking`: the template's thinking switch, `reasoning_effort` its effort
    variable (gpt-oss's; None: the template's default)."""
    rendered = tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=enable_thinking, reasoning_effort=reasoning_effort)
    tokens = tokenizer.encode(rendered + answer_start, add_special_tokens=False)
    history = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools, enable_thinking=enable_thinking,
                                      reasoning_effort=reasoning_effort),
        add_special_tokens=False,
    )
    is_prefix = 0 < len(history) < len(tokens) and tokens[: len(history)] == history
    return ChatPrompt(tokens, len(history) if is_prefix else None)


_PROBE_TOOL = {"type": "function", "function": {"name": "mlxkv_probe_tool_7f3a", "description": "", "parameters": {"type": "object"}}}


def template_takes_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders a `tools` list (Qwen, Hermes, Llama 3.x); else the caller
    describes the tools itself."""
    probe = [{"role": "user", "content": "hi"}]
    try:
        return "mlxkv_probe_tool_7f3a" in tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL])
    except ValueError:
        return False
