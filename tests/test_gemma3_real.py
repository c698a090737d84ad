"""Gemma 3 270M (gemma3 GGUF: Q4_K, Q5_0, Q6_K, Q8_0 tensors, sliding window 512), the second real
model. Real weights, from the `gemma3` dependency group; skipped where it is not installed."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.engine.cache_services import build_tiers
from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding
from mlxkv_inference._mlx_lm import load_directory, mlx_lm_step_tokens
from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.models.gguf_file import read_gguf_file
from mlxkv_inference.models.gguf_reader import read_gguf
from mlxkv_inference.tokenizer.gguf_spm_merges import spm_merges, spm_merges_by_lookup
from tests.test_gguf_file import assert_reads_like_gguf
from tests.test_gguf_quants import dequantized
from tools.mlx_lm_reference import write_mlx_lm_directory

FIBONACCI = "def fibonacci(n):"
LLAMA_CPP_FIBONACCI = "\n    if n == 0:\n        return 0\n    elif n == 1"  # llama.cpp's greedy continuation


@pytest.fixture(scope="module")
def gemma3_file(gemma3_path: Path) -> tuple[dict[str, mx.array], gguf.GGUFReader]:
    """The file as mlxkv reads it, and gguf's reader over it."""
    return read_gguf(gemma3_path)[0], gguf.GGUFReader(gemma3_path)


def test_gemma3_every_tensor_equals_the_reference_dequantization(gemma3_file: tuple[dict[str, mx.array], gguf.GGUFReader]) -> None:
    weights, reader = gemma3_file
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        base = tensor.name.removesuffix(".weight")
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert np.array_equal(dequantized(weights, base), reference), tensor.name
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    assert types == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}


def test_gemma3_file_reads_as_gguf_reads_it(gemma3_path: Path, gemma3_file: tuple[dict[str, mx.array], gguf.GGUFReader]) -> None:
    # The 262,144 pieces, scores and types of the vocabulary included.
    file = read_gguf_file(gemma3_path)
    assert_reads_like_gguf(file, gemma3_file[1])
    assert len(file.metadata["tokenizer.ggml.tokens"]) == len(file.metadata["tokenizer.ggml.scores"]) == 262_144


def test_gemma3_vocabulary_merges_equal_the_lookup_merges(gemma3_path: Path) -> None:
    metadata = read_gguf_file(gemma3_path).metadata
    tokens, scores, types = (metadata[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    vocab = dict(zip(tokens, range(len(tokens))))
    merges = spm_merges(tokens, scores, types, vocab)
    assert merges == spm_merges_by_lookup(tokens, scores, types, vocab)
    assert len(merges) == 513_511


def test_gemma3_norm_weights_come_back_exactly_as_stored(gemma3: MlxAutoregressiveBinding,
                                                         gemma3_file: tuple[dict[str, mx.array], gguf.GGUFReader]) -> None:
    # llama.cpp stores 1 + w; the model holds w and adds the 1 at run time: the sum must be bitwise the stored value.
    stored, _ = gemma3_file
    layer = gemma3.model.model.layers[7]
    assert mx.array_equal(1.0 + layer.pre_feedforward_layernorm.weight, stored["blk.7.ffn_norm.weight"]).item()
    assert mx.array_equal(1.0 + layer.self_attn.k_norm.weight, stored["blk.7.attn_k_norm.weight"]).item()
    assert mx.array_equal(1.0 + gemma3.model.model.norm.weight, stored["output_norm.weight"]).item()


def test_gemma3_tokenizer_gives_gemma_s_own_ids(gemma3: MlxAutoregressiveBinding) -> None:
    # Ids from Gemma 3's Hugging Face tokenizer.json (the same strings, add_special_tokens=True).
    text = "    if n == 0:\n\treturn  naïve 日本 🙂"
    ids = [2, 140, 584, 538, 1251, 236743, 236771, 236787, 107, 255968, 2060, 138, 1789, 238527, 560, 33375, 57235]
    assert gemma3.tokenizer.encode(text) == ids
    assert gemma3.tokenizer.decode(ids[1:]) == text
    assert gemma3.tokenizer.encode("Hello, world!") == [2, 9259, 236764, 1902, 236888]


def test_gemma3_continues_fibonacci_as_llama_cpp_does(gemma3_native: MlxAutoregressiveBinding) -> None:
    prompt = gemma3_native.tokenizer.encode(FIBONACCI)
    result = Generation(gemma3_native, prompt, GenerationParams(max_tokens=24)).run()
    assert result.text.startswith(LLAMA_CPP_FIBONACCI)


def test_gemma3_as_mlx_lm_directory_generates_what_mlxkv_does(gemma3: MlxAutoregressiveBinding, gemma3_path: Path,
                                                                tmp_path: Path) -> None:
    directory = write_mlx_lm_directory(tmp_path / "gemma3", gemma3_path)
    model, _, config = load_directory(directory)
    assert config["model_type"] == "gemma3_text"
    prompt = gemma3.tokenizer.encode(FIBONACCI)
    ours = Generation(gemma3, prompt, GenerationParams(max_tokens=12, ignore_eos=True)).run()
    assert mlx_lm_step_tokens(model, list(prompt), 12) == list(ours.token_ids)
    assert ours.text.startswith("\n    if n == 0:")


def long_prompt(binding: MlxAutoregressiveBinding) -> list[int]:
    """A ~560-token prompt: longer than the 512-token sliding window."""
    lines = [f"    total_{i} = compute(values[{i}], scale={i % 7})" for i in range(40)]
    tokens = binding.tokenizer.encode("def summary(values):\n" + "\n".join(lines) + "\n")
    assert len(tokens) > 512
    return tokens


def test_gemma3_prefix_reuse_across_the_sliding_window_matches_a_cold_run(
    gemma3_native: MlxAutoregressiveBinding, tmp_path: Path
) -> None:
    binding = gemma3_native
    assert sum(isinstance(c, RotatingKVCache) for c in binding.make_cache()) == 15  # 3 of 18 layers are global
    params = GenerationParams(max_tokens=8, ignore_eos=True)
    first_prompt = long_prompt(binding)
    tiers, _ = build_tiers(binding, ram_bytes=1 << 30, ssd_dir=tmp_path, ssd_bytes=1 << 30)
    generator = CachedGenerator(binding, tiers)
    first = generator.start(first_prompt, params)
    first_tokens = list(first.run().token_ids)
    generator.settle(first)
    prompt = first_prompt + first_tokens + binding.tokenizer.encode("    return total_0", add_special_tokens=False)
    cold = Generation(binding, prompt, params).run().token_ids

    warm = generator.start(prompt, params)  # from RAM
    warm_result = warm.run()
    generator.settle(warm)
    assert tiers.close(60).durable
    assert warm_result.cached_tokens == len(first_prompt) + len(first_tokens) - 1
    assert warm_result.token_ids == cold

    restarted_tiers, _ = build_tiers(binding, ram_bytes=1 << 30, ssd_dir=tmp_path, ssd_bytes=1 << 30)  # a new process's tiers
    restored = CachedGenerator(binding, restarted_tiers).start(prompt, params)  # from the SSD
    restored_result = restored.run()
    assert restored_result.cached_tokens >= len(first_prompt)
    assert restored_result.token_ids == cold
    assert restarted_tiers.close(60).durable
