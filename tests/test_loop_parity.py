"""Greedy parity with mlx-lm: the same model object and prompt ids give the same token ids."""

from __future__ import annotations

import pytest

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding
from mlxkv_inference._mlx_lm import mlx_lm_step_tokens, mlx_lm_stream_tokens, wrap_tokenizer
from mlxkv_inference.tokenizer.gguf_tokenizer import GgufTokenizer
from tests.factories import TINY_CONFIGS, make_prompt, make_tiny_binding


def our_tokens(binding: MlxAutoregressiveBinding, prompt: list[int], max_tokens: int, prefill_chunk: int = 512) -> list[int]:
    params = GenerationParams(max_tokens=max_tokens, prefill_chunk=prefill_chunk, ignore_eos=True)
    return list(Generation(binding, prompt, params).run().token_ids)


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_tiny_model_greedy_matches_mlx_lm(kind: str) -> None:
    binding = make_tiny_binding(kind)
    # 20 prompt tokens + 64 generated run well past gemma3_text's 8-token sliding window.
    prompt = make_prompt(20)
    ours = our_tokens(binding, prompt, 64)
    assert ours == mlx_lm_step_tokens(binding.model, prompt, 64, prefill_step_size=512)
    assert len(set(ours)) > 8  # the random model is not degenerate


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "qwen3_next"])
def test_chunked_prefill_matches_mlx_lm_with_same_chunks(kind: str) -> None:
    binding = make_tiny_binding(kind, seed=3)
    prompt = make_prompt(45, seed=2)
    assert our_tokens(binding, prompt, 24, prefill_chunk=16) == mlx_lm_step_tokens(
        binding.model, prompt, 24, prefill_step_size=16
    )


EMBEDDED_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.mark.parametrize("text", EMBEDDED_PROMPTS)
def test_embedded_greedy_matches_mlx_lm_stream_generate(text: str, embedded: MlxAutoregressiveBinding) -> None:
    tokenizer = embedded.tokenizer
    assert isinstance(tokenizer, GgufTokenizer)
    prompt = tokenizer.encode(text)
    ours = Generation(embedded, prompt, GenerationParams(max_tokens=64)).run().token_ids
    wrapper = wrap_tokenizer(tokenizer.backend, sorted(tokenizer.eos_token_ids))
    theirs = mlx_lm_stream_tokens(embedded.model, wrapper, prompt, 64, prefill_step_size=512)
    assert list(ours) == theirs
    assert len(theirs) > 8
