"""A SentencePiece-style BPE (`tokenizer.ggml.model` = "llama": pieces and scores, byte fallback)
rebuilt as a `tokenizers` BPE, as Gemma's GGUF files carry it.

llama.cpp's SPM tokenizer merges, again and again, the adjacent pair whose concatenation is the
vocabulary piece of highest score, and spells what remains in `<0xXX>` byte pieces. A BPE whose
merges are every split of a piece into two pieces, ranked by the piece's score (the ordering
`transformers`' SentencePiece converter uses), makes the same choices (`gguf_spm_merges`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers

from mlxkv_inference.tokenizer.gguf_spm_merges import spm_merges

__all__ = ["spm_tokenizer"]

_SPACE = "\u2581"  # SentencePiece's visible space


def spm_tokenizer(metadata: dict[str, Any], types: Sequence[int]) -> Tokenizer:
    """The BPE over `tokenizer.ggml.tokens` / `scores` (special tokens are added by the caller)."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    scores: list[float] = [float(s) for s in metadata["tokenizer.ggml.scores"]]
    vocab = dict(zip(tokens, range(len(tokens))))
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types, vocab), byte_fallback=True, fuse_unk=True,
                     unk_token=tokens[int(unk)] if unk is not None else None)
    tokenizer = Tokenizer(bpe)
    steps: list[Any] = [normalizers.Replace(" ", _SPACE)]
    if bool(metadata.get("tokenizer.ggml.add_space_prefix", True)):
        steps.insert(0, normalizers.Prepend(_SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer
