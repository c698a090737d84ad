"""A SentencePiece-style BPE (`tokenizer.ggml.model` = "llama": pieces and scores, byte fallback)
rebuilt as a `tokenizers` BPE, as Gemma's GGUF files carry it.

llama.cpp's SPM tokenizer merges, again and again, the adjacent pair whose concatenation is the
vocabulary piece of highest score, and spells what remains in `<0xXX>` byte pieces. A BPE whose
merges are every split of a piece into two pieces, ranked by the piece's score (the ordering
`transformers`' SentencePiece converter uses), makes the same choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers

__all__ = ["spm_tokenizer"]

_NORMAL = 1  # llama.cpp token type: a piece merges may produce
_SPACE = "\u2581"  # SentencePiece's visible space


def spm_tokenizer(metadata: dict[str, Any], types: Sequence[int]) -> Tokenizer:
    """The BPE over `tokenizer.ggml.tokens` / `scores` (special tokens are added by the caller)."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    scores: list[float] = [float(s) for s in metadata["tokenizer.ggml.scores"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab=vocab, merges=_merges(tokens, scores, types, vocab), byte_fallback=True, fuse_unk=True,
                     unk_token=tokens[int(unk)] if unk is not None else None)
    tokenizer = Tokenizer(bpe)
    steps: list[Any] = [normalizers.Replace(" ", _SPACE)]
    if bool(metadata.get("tokenizer.ggml.add_space_prefix", True)):
        steps.insert(0, normalizers.Prepend(_SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _merges(tokens: list[str], scores: list[float], types: Sequence[int], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two known pieces, by the piece's score (highest first),
    then by the ids of its halves."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score, kind in zip(tokens, scores, types, strict=True):
        if kind != _NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]
