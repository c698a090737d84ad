"""An independent reference of llama.cpp's BPE tokenization, the oracle for our GGUF tokenizer.

It follows llama.cpp's algorithm step by step: split out special tokens, apply the pre-tokenizer
regexes one after another (keeping unmatched spans as pieces), map bytes to GPT-2's unicode
alphabet, then merge the lowest-ranked adjacent pair until none applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import regex

# llama.cpp's regexes for LLAMA_VOCAB_PRE_TYPE_SMOLLM, applied in order.
SMOLLM_REGEXES = (
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


class ReferenceBpe:
    def __init__(self, tokens: Sequence[str], merges: Sequence[str], specials: Sequence[str]) -> None:
        self._ids = {t: i for i, t in enumerate(tokens)}
        self._ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self._specials = sorted(specials, key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for fragment, is_special in self._split_specials(text):
            if is_special:
                ids.append(self._ids[fragment])
                continue
            for piece in self._pre_tokenize(fragment):
                mapped = "".join(_byte_to_unicode()[b] for b in piece.encode("utf-8"))
                ids.extend(self._ids[s] for s in self._bpe(mapped))
        return ids

    def _split_specials(self, text: str) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        i = start = 0
        while i < len(text):
            hit = next((s for s in self._specials if text.startswith(s, i)), None)
            if hit is None:
                i += 1
                continue
            if start < i:
                out.append((text[start:i], False))
            out.append((hit, True))
            i = start = i + len(hit)
        if start < len(text):
            out.append((text[start:], False))
        return out

    @staticmethod
    def _pre_tokenize(text: str) -> list[str]:
        pieces = [text]
        for pattern in SMOLLM_REGEXES:
            split: list[str] = []
            for piece in pieces:
                last = 0
                for m in regex.finditer(pattern, piece):
                    if m.start() > last:
                        split.append(piece[last : m.start()])
                    split.append(m.group())
                    last = m.end()
                if last < len(piece):
                    split.append(piece[last:])
            pieces = split
        return pieces

    def _bpe(self, word: str) -> list[str]:
        symbols = list(word)
        while len(symbols) > 1:
            ranked = [(self._ranks.get((a, b)), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
            candidates = [(r, i) for r, i in ranked if r is not None]
            if not candidates:
                break
            _, i = min(candidates)
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        return symbols
