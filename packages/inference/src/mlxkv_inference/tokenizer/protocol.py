"""What the loop and the servers need from a tokenizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

Message = Mapping[str, Any]


class Tokenizer(Protocol):
    """Text <-> token ids for one model, with its chat template and stop tokens."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, tools: Sequence[Message] | None = None,
        enable_thinking: bool | None = None, reasoning_effort: str | None = None,
    ) -> str:
        """Render `messages`; `tools` (OpenAI function specs) reach templates that take them, and so
        do `enable_thinking` (Qwen3's switch) and `reasoning_effort` (gpt-oss's) where they are not
        None (other templates ignore them)."""
        ...

    def content_hash(self) -> str:
        """sha256 hex digest of the tokenizer's canonical bytes: equal hashes tokenize alike."""
        ...
