"""Incremental detokenization: no broken UTF-8, stop strings never emitted, not even their start."""

from __future__ import annotations

import pytest

from mlxkv_inference import IncrementalDetokenizer, MlxAutoregressiveBinding
from tests.factories import ByteTokenizer


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.finish())
    return pieces


@pytest.mark.parametrize("text", ["日本語", "naïve café", "emoji 😀🎉 👨‍👩‍👧", "mixed é😀x"])
def test_multibyte_characters_split_across_tokens_are_held_until_complete(text: str) -> None:
    tokenizer = ByteTokenizer()  # one token per byte: every multi-byte character spans tokens
    pieces = feed(IncrementalDetokenizer(tokenizer), tokenizer.encode(text))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert pieces[0] == (text[0] if len(text[0].encode()) == 1 else "")


def test_stop_string_spanning_tokens_is_cut_and_never_emitted() -> None:
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, stop=["END"])
    pieces = feed(detok, tokenizer.encode("hello ENDING more"))
    assert "".join(pieces) == "hello "
    assert detok.stop_string == "END"
    # "E" and "EN" were held back: they could have been the start of the stop string.
    assert pieces[:8] == ["h", "e", "l", "l", "o", " ", "", ""]


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    pieces = feed(detok, tokenizer.encode("a STx"))
    assert pieces == ["a", " ", "", "", "STx", ""]
    assert not detok.stopped


def test_unfinished_stop_prefix_is_released_at_the_end() -> None:
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    assert "".join(feed(detok, tokenizer.encode("ab ST"))) == "ab ST"
    assert detok.text == "ab ST"


def test_earliest_of_several_stop_strings_wins() -> None:
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, stop=["world", "lo w"])
    assert "".join(feed(detok, tokenizer.encode("hello world"))) == "hel"
    assert detok.stop_string == "lo w"


def test_stop_string_inside_a_multibyte_sequence() -> None:
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, stop=["😀"])
    assert "".join(feed(detok, tokenizer.encode("hi 😀 there"))) == "hi "


def test_embedded_stop_spanning_bpe_tokens(embedded: MlxAutoregressiveBinding) -> None:
    tokenizer = embedded.tokenizer
    ids = tokenizer.encode("The capital of France is Paris. It is big.")
    detok = IncrementalDetokenizer(tokenizer, stop=["is Par"])
    assert "".join(feed(detok, ids)) == "The capital of France "


def test_embedded_word_initial_spaces_survive_incremental_decoding(embedded: MlxAutoregressiveBinding) -> None:
    tokenizer = embedded.tokenizer
    text = "  Indented code:\n\tx = 1  # café 日本 😀\n"
    pieces = feed(IncrementalDetokenizer(tokenizer), tokenizer.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        IncrementalDetokenizer(ByteTokenizer(), stop=[""])
