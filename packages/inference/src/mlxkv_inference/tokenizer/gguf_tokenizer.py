"""A tokenizer rebuilt from GGUF metadata: byte-level BPE (vocab, merges, token types), or
SentencePiece-style BPE (pieces, scores: `gguf_spm`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from mlxkv_inference.errors import UnsupportedModelError
from mlxkv_inference.tokenizer.chat_template import render_chat_template
from mlxkv_inference.tokenizer.gguf_spm import spm_tokenizer
from mlxkv_inference.tokenizer.protocol import Message

# llama.cpp token types: 3 = control, 4 = user defined. Both are matched whole in text.
_SPECIAL_TYPES = (3, 4)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> Any:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`."""
    if pre == "smollm":  # single digits, then GPT-2's split
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in ("gpt-2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in ("llama3", "llama-bpe"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise UnsupportedModelError(
        f"GGUF tokenizer pre-tokenizer {pre!r} is not supported; supported: smollm, gpt-2, default, llama-bpe"
    )


class GgufTokenizer:
    """Implements the `Tokenizer` protocol from a GGUF file's `tokenizer.*` metadata."""

    def __init__(self, metadata: dict[str, Any]) -> None:
        kind = str(metadata.get("tokenizer.ggml.model", ""))
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types = _ints(metadata.get("tokenizer.ggml.token_type"))
        if kind == "gpt2":
            self._tok = _byte_level_bpe(metadata, tokens)
        elif kind == "llama":
            self._tok = spm_tokenizer(metadata, types or [1] * len(tokens))
        else:
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)"
            )
        special = [tokens[i] for i, t in enumerate(types) if t in _SPECIAL_TYPES]
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        self._bos = _optional_int(metadata, "tokenizer.ggml.bos_token_id")
        self._add_bos = bool(_optional_int(metadata, "tokenizer.ggml.add_bos_token") or 0)
        eos = _optional_int(metadata, "tokenizer.ggml.eos_token_id")
        eot = _optional_int(metadata, "tokenizer.ggml.eot_token_id")
        self._eos = frozenset(i for i in (eos, eot) if i is not None)
        self._template = str(metadata.get("tokenizer.chat_template", ""))
        self._vocab_size = len(tokens)
        self._hash = hashlib.sha256(
            "\0".join([self._tok.to_str(), self._template, str(self._bos), str(self._add_bos), str(sorted(self._eos))]).encode()
        ).hexdigest()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def backend(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer` (for wrapping into other libraries)."""
        return self._tok

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def chat_template(self) -> str:
        """The chat template's source ("" for none): what tool-call formats are chosen from."""
        return self._template

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it: a megabyte prompt
        # tokenized on a server's worker thread would stall its event loop for seconds).
        ids: list[int] = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self._add_bos and self._bos is not None:
            ids.insert(0, self._bos)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out: str = self._tok.decode(list(ids), skip_special_tokens=False)
        return out

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, tools: Sequence[Message] | None = None,
        enable_thinking: bool | None = None, reasoning_effort: str | None = None,
    ) -> str:
        if not self._template:
            raise ValueError("this model has no chat template; use raw prompts")
        bos = self._tok.id_to_token(self._bos) if self._bos is not None else ""
        return render_chat_template(
            self._template, messages, add_generation_prompt=add_generation_prompt, bos_token=bos or "",
            tools=[dict(t) for t in tools] if tools else None,
            **({} if enable_thinking is None else {"enable_thinking": enable_thinking}),
            **({} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}),
        )

    def content_hash(self) -> str:
        return self._hash


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _ints(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, mx.array):
        out: list[int] = value.tolist()  # type: ignore[assignment]
        return out
    return [int(v) for v in value]


def _optional_int(metadata: dict[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    scalar = value.item() if isinstance(value, mx.array) else value
    return int(scalar)  # type: ignore[arg-type]  # GGUF ids are integer scalars
