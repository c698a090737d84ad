"""The SentencePiece-style GGUF vocabulary (pieces and scores, no merges: Gemma's) merges the
highest-scoring piece first and spells unknown characters in byte pieces, as llama.cpp's SPM
tokenizer does. A small synthetic vocabulary; Gemma 3's real one is in test_gemma3_real.py."""

from __future__ import annotations

from typing import Any

from mlxkv_inference.tokenizer.gguf_tokenizer import GgufTokenizer

PIECES = [("<unk>", 0.0, 2), ("<bos>", 0.0, 3), ("<eos>", 0.0, 3), ("<sep>", 0.0, 4),
          ("\u2581", -1.0, 1), ("a", -2.0, 1), ("b", -3.0, 1), ("ab", -4.0, 1), ("\u2581a", -5.0, 1), ("\u2581ab", -6.0, 1),
          ("ba", -0.5, 1)]  # "ba" scores highest: "bab" becomes b a b -> ba b
BYTES = [(f"<0x{i:02X}>", 0.0, 6) for i in range(256)]


def spm_metadata(**overrides: Any) -> dict[str, Any]:
    pieces = PIECES + BYTES
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [p for p, _, _ in pieces],
            "tokenizer.ggml.scores": [s for _, s, _ in pieces], "tokenizer.ggml.token_type": [t for _, _, t in pieces],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False, **overrides}


def test_highest_scoring_pieces_merge_first_and_spaces_become_the_visible_space() -> None:
    tokenizer = GgufTokenizer(spm_metadata())
    assert tokenizer.encode("ab ab") == [1, 7, 9]  # ab, ▁ab
    assert tokenizer.encode("bab", add_special_tokens=False) == [10, 6]  # ba (score -0.5) before ab (-4)
    assert tokenizer.decode([7, 9]) == "ab ab"


def test_unknown_characters_fall_back_to_byte_pieces_and_decode_back() -> None:
    tokenizer = GgufTokenizer(spm_metadata())
    ids = tokenizer.encode("a\u00e9", add_special_tokens=False)  # é is UTF-8 C3 A9
    assert ids == [5, len(PIECES) + 0xC3, len(PIECES) + 0xA9]
    assert tokenizer.decode(ids) == "a\u00e9"


def test_user_defined_pieces_match_whole_and_the_space_prefix_follows_the_metadata() -> None:
    assert GgufTokenizer(spm_metadata()).encode("a<sep>b", add_special_tokens=False) == [5, 3, 6]
    assert GgufTokenizer(spm_metadata(**{"tokenizer.ggml.add_space_prefix": True})).encode("ab", add_special_tokens=False) == [9]
