"""`spm_merges` (hashed arrays) gives exactly the list of `spm_merges_by_lookup` (one dict lookup
per split), on random vocabularies with the awkward cases in them and where the arrays give up."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mlxkv_inference.tokenizer import gguf_spm_merges
from mlxkv_inference.tokenizer.gguf_spm_merges import spm_merges, spm_merges_by_lookup

# NUL (the arrays' padding), the visible space, a letter with an accent, an astral-plane emoji.
ALPHABET = ["a", "b", "c", "\0", "\u2581", "é", "🙂"]


def random_vocabulary(seed: int, size: int = 3000) -> tuple[list[str], list[float], list[int]]:
    rng = random.Random(seed)
    pieces = dict.fromkeys(ALPHABET)
    while len(pieces) < size:
        pieces["".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 9)))] = None
    tokens = list(pieces)
    rng.shuffle(tokens)
    # Few distinct scores (many ties, 0.0 and -0.0 among them), some pieces not normal (types 2-6).
    scores = [rng.choice([0.0, -0.0, -1.5, -2.25, -7.0, 3.0]) for _ in tokens]
    types = [1 if rng.random() < 0.85 else rng.randint(2, 6) for _ in tokens]
    return tokens, scores, types


def both(tokens: list[str], scores: list[float], types: list[int]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    vocab = dict(zip(tokens, range(len(tokens))))
    return spm_merges(tokens, scores, types, vocab), spm_merges_by_lookup(tokens, scores, types, vocab)


@pytest.mark.parametrize("seed", range(4))
def test_random_vocabularies_give_the_lookup_merges(seed: int) -> None:
    tokens, scores, types = random_vocabulary(seed)
    assert gguf_spm_merges._splits(tokens, types) is not None  # the arrays, not the fallback
    fast, reference = both(tokens, scores, types)
    assert fast == reference
    assert len(reference) > 1000  # the vocabularies do split


def test_a_repeated_piece_keeps_its_last_id() -> None:
    tokens = ["a", "b", "ab", "a", "bab"]  # "a" twice: the lookup's dict holds id 3
    fast, reference = both(tokens, [0.0, -1.0, -2.0, -3.0, -0.5], [1] * 5)
    assert fast == reference == [("b", "ab"), ("a", "b")]


def test_a_piece_longer_than_the_arrays_take_gives_the_lookup_merges() -> None:
    long = "ab" * 40
    tokens = ["a", "b", "ab", "abab", long[:-1], long]
    fast, reference = both(tokens, [-1.0, -1.0, -2.0, -3.0, -4.0, -5.0], [1] * 6)
    assert fast == reference and (long[:-1], "b") in fast


def test_hash_collisions_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # With 2**32 as the base only a piece's last two code points reach the hash (mod 2**64).
    monkeypatch.setattr(gguf_spm_merges, "_BASE", np.uint64(1 << 32))
    # "xab" hashes like the piece "yab": a split of "xabd" it must not take.
    tokens, scores, types = ["x", "y", "a", "b", "d", "yab", "xabd"], [-1.0] * 7, [1] * 7
    assert gguf_spm_merges._splits(tokens, types) is not None
    assert both(tokens, scores, types) == ([], [])
    # Two pieces with one hash ("ab" and "yab"): the lookup runs instead.
    tokens, scores, types = [*tokens, "ab", "yabd"], [-1.0] * 9, [1] * 9
    assert gguf_spm_merges._splits(tokens, types) is None
    fast, reference = both(tokens, scores, types)
    assert fast == reference == [("y", "ab"), ("a", "b"), ("yab", "d")]


def test_mismatched_vocabulary_arrays_are_refused() -> None:
    with pytest.raises(ValueError, match="3 pieces has 2 scores"):
        spm_merges(["a", "b", "ab"], [0.0, 0.0], [1, 1, 1], {"a": 0, "b": 1, "ab": 2})


def test_a_nan_score_gives_the_lookup_merges() -> None:
    tokens, scores, types = random_vocabulary(7, size=300)
    scores[5] = float("nan")
    fast, reference = both(tokens, scores, types)
    assert fast == reference
