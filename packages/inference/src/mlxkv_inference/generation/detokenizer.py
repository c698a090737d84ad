"""Incremental detokenization with stop strings.

Text is released only when it is final: never a broken UTF-8 sequence (a token that ends inside
a multi-byte character is held until the character completes), never a stop string, and never
the start of one (a tail that could still grow into a stop string is held back).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxkv_inference.tokenizer.protocol import Tokenizer

_REPLACEMENT = "\ufffd"
# A character needs at most 4 bytes; byte-level tokens can split it across as many tokens.
_MAX_HELD_TOKENS = 4


class IncrementalDetokenizer:
    """Feed token ids one at a time; each `add` returns the text that is safe to show now."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._context: list[int] = []  # last decoded token, so word-initial spaces survive
        self._pending: list[int] = []
        self._text = ""  # all decoded text, stop string included
        self._emitted = 0
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text[: self._emitted]

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self._pending.append(token)
        piece = self._decode_pending()
        if piece.endswith(_REPLACEMENT) and len(self._pending) < _MAX_HELD_TOKENS:
            return ""
        self._text += piece
        self._context = self._pending[-1:]
        self._pending = []
        return self._release(final=False)

    def finish(self) -> str:
        """Release what is held at the end of the generation (an incomplete stop string prefix)."""
        if self.stopped:
            return ""
        if self._pending:
            self._text += self._decode_pending()
            self._pending = []
        return self._release(final=True)

    def _decode_pending(self) -> str:
        if not self._context:
            return self._tokenizer.decode(self._pending)
        prefix = self._tokenizer.decode(self._context)
        full = self._tokenizer.decode(self._context + self._pending)
        if full.startswith(prefix):
            return full[len(prefix) :]
        return self._tokenizer.decode(self._pending)

    def _release(self, *, final: bool) -> str:
        start = self._emitted
        hit = self._find_stop(start)
        if hit is not None:
            position, self.stop_string = hit
            self._emitted = position
            return self._text[start:position]
        end = len(self._text) if final else len(self._text) - self._held_tail()
        self._emitted = max(start, end)
        return self._text[start : self._emitted]

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self._text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:n]):
                    longest = n
                    break
        return longest
