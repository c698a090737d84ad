"""An adapter's greedy answers equal mlx-lm's `load(..., adapter_path=...)` token for token on the
same weights (MLX's kernels), for adapters trained here with mlx-lm's LoRA trainer."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxkv_inference import Generation, GenerationParams, load_binding
from mlxkv_inference._mlx_lm import load_with_adapter, mlx_lm_step_tokens
from tests.adapter_factories import adapted_caches, write_random_adapter, write_trained_adapter
from tests.factories import make_prompt, make_tiny_binding, save_mlx_lm_directory


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_trained_adapter_greedy_equals_mlx_lm_with_adapter_path(kind: str, tmp_path: Path) -> None:
    base = make_tiny_binding("llama", seed=5)
    directory = save_mlx_lm_directory(base, tmp_path / "tiny-llama")
    adapter = write_trained_adapter(base, tmp_path / "adapter", kind=kind)
    binding = load_binding(directory)
    prompt = make_prompt(19, seed=4)
    params = GenerationParams(max_tokens=24, ignore_eos=True, prefill_chunk=8)
    ours = list(Generation(binding, prompt, params, caches=adapted_caches(binding, adapter)).run().token_ids)
    theirs = mlx_lm_step_tokens(load_with_adapter(directory, adapter), prompt, 24, prefill_step_size=8)
    plain = list(Generation(binding, prompt, params).run().token_ids)
    assert ours == theirs
    assert ours != plain  # the adapter changes the answer


def test_random_adapter_on_a_qwen3_model_equals_mlx_lm(tmp_path: Path) -> None:
    base = make_tiny_binding("qwen3", seed=2)
    directory = save_mlx_lm_directory(base, tmp_path / "tiny-qwen3")
    adapter = write_random_adapter(base, tmp_path / "adapter", seed=3, layers=[1])
    binding = load_binding(directory)
    prompt = make_prompt(12, seed=9)
    params = GenerationParams(max_tokens=20, ignore_eos=True)
    ours = list(Generation(binding, prompt, params, caches=adapted_caches(binding, adapter)).run().token_ids)
    assert ours == mlx_lm_step_tokens(load_with_adapter(directory, adapter), prompt, 20)
