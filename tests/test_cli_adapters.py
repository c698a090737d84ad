"""`mlxkv generate --adapter NAME=PATH`: the answer under the adapter (the same as the library's),
and an adapter for another model refused before generating, naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxkv.cli import main
from mlxkv_inference import Generation, GenerationParams, load_binding
from tests.adapter_factories import adapted_caches, write_random_adapter
from tests.factories import make_tiny_binding, save_mlx_lm_directory


def test_generate_answers_under_the_adapter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = make_tiny_binding("llama", seed=5)
    directory = save_mlx_lm_directory(base, tmp_path / "tiny-llama")
    adapter = write_random_adapter(base, tmp_path / "adapter", seed=1)
    argv = ["generate", "--model", str(directory), "--raw", "hello", "-m", "10", "--no-ssd-cache",
            "--cpu-kernels", "mlx"]
    assert main([*argv, "--adapter", f"mine={adapter}"]) == 0
    adapted = capsys.readouterr().out
    assert main(argv) == 0
    plain = capsys.readouterr().out
    binding = load_binding(directory)
    prompt = binding.tokenizer.encode("hello")
    params = GenerationParams(max_tokens=10)
    expected = Generation(binding, prompt, params, caches=adapted_caches(binding, adapter)).run().text
    assert adapted == expected + "\n" != plain


def test_generate_refuses_an_adapter_of_another_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = save_mlx_lm_directory(make_tiny_binding("llama", seed=5), tmp_path / "tiny-llama")
    other = make_tiny_binding("llama", seed=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    adapter = write_random_adapter(other, tmp_path / "other", base_model="tiny-other")
    assert main(["generate", "--model", str(directory), "--raw", "hi", "--no-ssd-cache", "--adapter", f"o={adapter}"]) == 2
    assert "(trained on tiny-other) does not fit model tiny-llama: model.layers.0.mlp.down_proj" in capsys.readouterr().err
