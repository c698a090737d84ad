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


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Message]) -> ChatPrompt:
    tokens = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    history = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False), add_special_tokens=False)
    is_prefix = 0 < len(history) < len(tokens) and tokens[: len(history)] == history
    return ChatPrompt(tokens, len(history) if is_prefix else None)
