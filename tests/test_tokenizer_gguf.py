"""The GGUF tokenizer matches llama.cpp's BPE algorithm (reference oracle) and round-trips."""

from __future__ import annotations

from typing import Any

import pytest

from mlxkv_inference import embedded_model_path
from mlxkv_inference._mlx_lm import load_gguf_file
from mlxkv_inference.tokenizer.gguf_tokenizer import GgufTokenizer
from tests.bpe_reference import ReferenceBpe

TRICKY = [
    "Hello world",
    "  leading   spaces and    runs of  spaces   ",
    "tabs\t\there\t and\n\n\nnewlines\r\n",
    "def f(x):\n\treturn x ** 2  # 12345\n\n    if x != 0: pass",
    "café naïve résumé Ærøskøbing über",
    "日本語のテキスト、中文字符和한국어",
    "emoji 😀🎉 family 👨‍👩‍👧 flag 🇫🇷",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "numbers 1234567890 3.14159 1e-5 0x1F",
    "I'm you're they've we'll she'd it's",
    "   ",
    "\n",
    "",
]


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    return load_gguf_file(str(embedded_model_path()))[1]


@pytest.fixture(scope="module")
def tokenizer(metadata: dict[str, Any]) -> GgufTokenizer:
    return GgufTokenizer(metadata)


@pytest.fixture(scope="module")
def reference(metadata: dict[str, Any]) -> ReferenceBpe:
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = metadata["tokenizer.ggml.token_type"].tolist()
    specials = [t for t, kind in zip(tokens, types) if kind in (3, 4)]
    return ReferenceBpe(tokens, list(metadata["tokenizer.ggml.merges"]), specials)


@pytest.mark.parametrize("text", TRICKY)
def test_gguf_tokenizer_matches_llama_cpp_reference(text: str, tokenizer: GgufTokenizer, reference: ReferenceBpe) -> None:
    assert tokenizer.encode(text) == reference.encode(text)


@pytest.mark.parametrize("text", TRICKY)
def test_gguf_tokenizer_round_trips(text: str, tokenizer: GgufTokenizer) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_encode_to_single_ids(tokenizer: GgufTokenizer) -> None:
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]


def test_eos_and_chat_template_come_from_metadata(tokenizer: GgufTokenizer) -> None:
    assert tokenizer.eos_token_ids == frozenset({2})
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tokenizer_hash_is_stable_and_content_based(metadata: dict[str, Any]) -> None:
    first, second = GgufTokenizer(metadata), GgufTokenizer(metadata)
    assert first.content_hash() == second.content_hash()
    changed = dict(metadata, **{"tokenizer.chat_template": "{{ messages }}"})
    assert GgufTokenizer(changed).content_hash() != first.content_hash()
