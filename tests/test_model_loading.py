"""Model loading: GGUF metadata checks, local mlx-lm directories, identities."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv_inference import (
    Generation, GenerationParams, KvScheme, MlxAutoregressiveBinding, ModelLoadError, UnsupportedModelError, load_binding,
)
from mlxkv_inference.models.gguf import gguf_config
from tests.factories import make_prompt, make_tiny_binding, save_mlx_lm_directory

LLAMA_META = {
    "general.architecture": "llama",
    "general.file_type": mx.array(3),
    "llama.attention.head_count": mx.array(9),
    "llama.embedding_length": mx.array(576),
    "llama.block_count": mx.array(30),
    "llama.feed_forward_length": mx.array(1536),
    "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
    "llama.vocab_size": mx.array(100),
}


def test_unsupported_gguf_architecture_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match="architecture 'qwen2' is not supported; supported: llama, gemma3"):
        gguf_config({**LLAMA_META, "general.architecture": "qwen2"}, {})


def test_the_file_type_label_does_not_decide_what_loads() -> None:
    # Q4_K_M (15) is a label; each tensor's own type is checked when the file is read (test_gguf_quants).
    assert gguf_config({**LLAMA_META, "general.file_type": mx.array(15)}, {})["model_type"] == "llama"


def test_gguf_config_maps_gemma3_metadata() -> None:
    meta = {"general.architecture": "gemma3", "gemma3.attention.head_count": 4, "gemma3.embedding_length": 640,
            "gemma3.block_count": 18, "gemma3.feed_forward_length": 2048, "gemma3.attention.head_count_kv": 1,
            "gemma3.attention.key_length": 256, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.attention.sliding_window": 512, "gemma3.rope.freq_base": 1e6, "gemma3.context_length": 32768,
            "tokenizer.ggml.tokens": ["a"] * 300}
    config = gguf_config(meta, {})
    assert (config["model_type"], config["head_dim"], config["query_pre_attn_scalar"], config["vocab_size"]) == (
        "gemma3_text", 256, 256, 300)
    assert (config["sliding_window"], config["sliding_window_pattern"], config["rope_local_base_freq"]) == (512, 6, 10000.0)
    assert "rope_scaling" not in config and config["tie_word_embeddings"] is True
    scaled = gguf_config({**meta, "gemma3.rope.scaling.factor": 8.0, "gemma3.block_count": 62}, {})
    assert scaled["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert scaled["query_pre_attn_scalar"] == 160  # the 27B: hidden / heads


def test_gguf_config_maps_llama_metadata() -> None:
    config = gguf_config(LLAMA_META, {})
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 9, 64)
    assert config["tie_word_embeddings"] is True


def test_missing_model_path_is_an_error_and_never_a_download(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist.*nothing is downloaded"):
        load_binding(tmp_path / "no-such-model")


def test_local_mlx_lm_directory_loads_and_generates_like_the_original(tmp_path: Path) -> None:
    original = make_tiny_binding("qwen3")
    save_mlx_lm_directory(original, tmp_path / "tiny-qwen3")
    loaded = load_binding(tmp_path / "tiny-qwen3")
    prompt = make_prompt(10)
    params = GenerationParams(max_tokens=16)
    assert Generation(loaded, prompt, params).run().token_ids == Generation(original, prompt, params).run().token_ids
    assert loaded.model_id == "tiny-qwen3"
    assert loaded.eos_token_ids == frozenset({256})
    assert len(loaded.tokenizer_hash) == 64


def test_config_fingerprint_separates_kv_schemes_and_weights() -> None:
    base = make_tiny_binding("llama")
    assert make_tiny_binding("llama").config_fingerprint == base.config_fingerprint
    assert make_tiny_binding("llama", kv_scheme=KvScheme(bits=8)).config_fingerprint != base.config_fingerprint
    assert make_tiny_binding("llama", seed=1).config_fingerprint != base.config_fingerprint


def test_embedded_binding_identity(embedded: MlxAutoregressiveBinding) -> None:
    assert embedded.model_id == "SmolLM2-135M-Instruct-Q4_1"
    assert embedded.eos_token_ids == frozenset({2})
    assert embedded.config["num_hidden_layers"] == 30
    # 4-bit weights with float32 scales and biases (upcast for MLX's CPU kernels).
    assert 80e6 < embedded.weight_bytes < 140e6
