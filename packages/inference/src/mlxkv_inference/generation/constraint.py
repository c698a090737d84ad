"""Grammar-constrained decoding: a per-sequence token mask from llguidance.

    Grammar (json_schema | lark | regex)  --compile_grammar-->  llguidance grammar (validated)
    GrammarConstraint (one per sequence): mask(logits) before sampling, consume(token) after it

The mask is applied with portable MLX ops (llguidance's MLX helper is a Metal kernel), so it runs on
the CPU backend as on the GPU. EOS is allowed only where the grammar accepts.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance as llg
import mlx.core as mx
import numpy as np

from mlxkv_inference.tokenizer.protocol import Tokenizer

GrammarKind = Literal["json_schema", "lark", "regex"]
KINDS: tuple[GrammarKind, ...] = ("json_schema", "lark", "regex")
# NOTE: JSON is written as json.dumps writes it, no free whitespace: a small model cannot pad an
# answer with newlines until it runs out of tokens. A schema's own "x-guidance" overrides this.
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Grammar:
    """What a generation must match: a JSON schema (as JSON text), a Lark grammar or a regex."""

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @staticmethod
    def json_schema(schema: dict[str, Any]) -> Grammar:
        # Not sorted: the schema's property order is the order of the output.
        return Grammar("json_schema", json.dumps(schema, separators=(",", ":")))

    @property
    def digest(self) -> str:
        """sha256 of kind and source: what a checkpoint's request key holds."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()

    def to_llguidance(self) -> str:
        if self.kind == "json_schema":
            try:
                return str(llg.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT))  # type: ignore[arg-type]
            except ValueError as e:
                raise ValueError(f"the JSON schema is not a JSON object: {e}") from None
        if self.kind == "lark":
            return str(llg.LLMatcher.grammar_from_lark(self.source))
        return str(llg.LLMatcher.grammar_from_regex(self.source))


def compile_grammar(grammar: Grammar, tokenizer: Tokenizer) -> str:
    """The llguidance grammar for `grammar`, checked against `tokenizer`.

    Raises:
        ValueError: the grammar (schema, Lark, regex) does not compile; the message says where.
    """
    compiled = grammar.to_llguidance()
    error = llg.LLMatcher.validate_grammar(compiled, llg_tokenizer(tokenizer))
    if error and not error.startswith("WARNING"):
        raise ValueError(f"the {grammar.kind.replace('_', ' ')} does not compile: {error.strip()}")
    return compiled


class GrammarConstraint:
    """One sequence's matcher: masks logits to the tokens the grammar allows next.

    `replay` holds tokens generated before a restart: the matcher consumes them first, so a resumed
    generation is constrained exactly as the uninterrupted one was.
    """

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer, replay: Sequence[int] = ()) -> None:
        self._tokenizer = llg_tokenizer(tokenizer)
        self._matcher = llg.LLMatcher(self._tokenizer, compile_grammar(grammar, tokenizer), log_level=0)
        self._vocab = self._tokenizer.vocab_size
        self._shifts = mx.arange(32, dtype=mx.uint32)
        for token in replay:
            self.consume(token)

    def consume(self, token: int) -> None:
        """Advance past the chosen `token` (one the last mask allowed)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar matcher rejected token {token}: {self._matcher.get_error()}")

    def allowed(self) -> mx.array:
        """The boolean vocabulary mask of the tokens allowed next, shape (V,)."""
        words = mx.array(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint32))
        bits = (words[:, None] >> self._shifts) & 1
        return bits.reshape(-1)[: self._vocab].astype(mx.bool_)

    def apply(self, logits: mx.array) -> mx.array:
        """`logits` (1, V') with every token the grammar forbids at -inf (ids past the tokenizer too)."""
        mask = self.allowed()
        width = logits.shape[-1]
        if width > self._vocab:
            mask = mx.concatenate([mask, mx.zeros((width - self._vocab,), dtype=mx.bool_)])
        elif width < self._vocab:
            mask = mask[:width]
        return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))

    @property
    def accepting(self) -> bool:
        return bool(self._matcher.is_accepting())


_TOKENIZERS: dict[str, llg.LLTokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()


def llg_tokenizer(tokenizer: Tokenizer) -> llg.LLTokenizer:
    """llguidance's view of `tokenizer` (built once per tokenizer hash: it reads the whole vocabulary)."""
    key = tokenizer.content_hash()
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(key)
        if cached is None:
            cached = llg.LLTokenizer(_tokenizer_json(tokenizer), eos_token=sorted(tokenizer.eos_token_ids))
            _TOKENIZERS[key] = cached
        return cached


def _tokenizer_json(tokenizer: Tokenizer) -> str:
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} exposes no `tokenizers` backend; grammars need one")
    return str(backend.to_str())
