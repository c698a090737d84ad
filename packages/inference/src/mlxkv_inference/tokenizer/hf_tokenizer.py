"""The `Tokenizer` protocol over an mlx-lm model directory's Hugging Face tokenizer."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlxkv_inference import _mlx_lm
from mlxkv_inference.tokenizer.protocol import Message

# Files whose bytes define how a directory's tokenizer behaves, hashed in this order.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")


class HfTokenizer:
    """Wraps mlx-lm's `TokenizerWrapper` (a transformers tokenizer) loaded from `directory`."""

    def __init__(self, wrapper: Any, directory: Path) -> None:
        self._wrapper = wrapper
        self._eos = frozenset(int(i) for i in _mlx_lm.eos_token_ids(wrapper))
        self._vocab_size = _mlx_lm.tokenizer_vocab_size(wrapper)
        self._hash = directory_tokenizer_hash(directory)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def wrapper(self) -> Any:
        """mlx-lm's `TokenizerWrapper` (for calling mlx-lm's own generation)."""
        return self._wrapper

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` behind the transformers tokenizer (for grammar masks)."""
        return self._wrapper._tokenizer.backend_tokenizer

    @property
    def chat_template(self) -> str:
        """The chat template's source ("" for none): what tool-call formats are chosen from."""
        template = getattr(self._wrapper, "chat_template", None)
        return template if isinstance(template, str) else ""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return _mlx_lm.tokenizer_encode(self._wrapper, text, add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return _mlx_lm.tokenizer_decode(self._wrapper, list(ids))

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, tools: Sequence[Message] | None = None,
        enable_thinking: bool | None = None, reasoning_effort: str | None = None,
    ) -> str:
        specs = [dict(t) for t in tools] if tools else None
        extra: dict[str, object] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        if reasoning_effort is not None:
            extra["reasoning_effort"] = reasoning_effort
        return _mlx_lm.tokenizer_chat_template(self._wrapper, [dict(m) for m in messages], add_generation_prompt, specs, **extra)

    def content_hash(self) -> str:
        return self._hash


def directory_tokenizer_hash(directory: Path) -> str:
    """sha256 over the tokenizer files present in `directory` (tokenizer.json first)."""
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = directory / name
        if path.is_file():
            digest.update(name.encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()
