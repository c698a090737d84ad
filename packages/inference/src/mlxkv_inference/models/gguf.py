"""GGUF -> mlx-lm model (llama, gemma3).

`gguf_reader` returns GGUF's tensors as MLX affine triples (weight, scales, biases) or float
arrays, and the metadata. This module maps GGUF tensor names to mlx-lm's, undoes the Q/K row
permutation llama.cpp applies to llama for its rope layout (`gguf_gemma3`: Gemma's conventions),
and quantizes the model's layers to match each triple.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference import _mlx_lm
from mlxkv_inference.errors import ModelLoadError, UnsupportedModelError
from mlxkv_inference.models.gguf_gemma3 import GEMMA3_LAYER_NAMES, gemma3_config, unshift_norms
from mlxkv_inference.models.gguf_quants import GROUP_SIZE
from mlxkv_inference.models.gguf_reader import read_gguf, scalar

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


@dataclass(frozen=True, slots=True)
class GgufModel:
    """An mlx-lm model built from a GGUF file, with the metadata the tokenizer needs."""

    model: nn.Module
    config: dict[str, Any]
    metadata: dict[str, Any]


def load_gguf(path: Path) -> GgufModel:
    """Load a llama or gemma3 GGUF file into mlx-lm's model (float32 activations)."""
    weights, metadata = read_gguf(path)
    config = gguf_config(metadata, weights)
    layer_names = _LAYER_NAMES if config["model_type"] == "llama" else GEMMA3_LAYER_NAMES
    mapped = {_map_name(name, layer_names): _upcast(t) for name, t in weights.items()}
    if config["model_type"] == "llama":
        _unpermute_qk(mapped, config)
    else:
        unshift_norms(mapped)
    model = _mlx_lm.build_model(config)
    mapped = _mlx_lm.sanitize(model, mapped)  # a tied model drops its lm_head here
    _quantize_like(model, mapped)
    model.load_weights(list(mapped.items()), strict=True)
    _mlx_lm.eval_parameters(model)
    model.eval()
    return GgufModel(model=model, config=config, metadata=metadata)


def gguf_config(metadata: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    """mlx-lm config from `llama.*` or `gemma3.*` metadata; raises on unsupported features."""
    arch = str(metadata.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if arch == "gemma3":
        return gemma3_config(metadata, weights)
    if "llama.rope.scaling.type" in metadata or "rope_freqs.weight" in weights:
        raise UnsupportedModelError("GGUF rope scaling is not supported (plain llama rope only)")
    heads = int(scalar(metadata, "llama.attention.head_count"))
    hidden = int(scalar(metadata, "llama.embedding_length"))
    head_dim = int(scalar(metadata, "llama.attention.key_length", default=hidden // heads))
    vocab = int(scalar(metadata, "llama.vocab_size", default=len(metadata.get("tokenizer.ggml.tokens", []))))
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(scalar(metadata, "llama.block_count")),
        "intermediate_size": int(scalar(metadata, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(scalar(metadata, "llama.attention.head_count_kv", default=heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(scalar(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "rope_theta": float(scalar(metadata, "llama.rope.freq_base", default=10000.0)),
        "max_position_embeddings": int(scalar(metadata, "llama.context_length", default=2048)),
        "tie_word_embeddings": "output.weight" not in weights,
    }


def _map_name(name: str, layer_names: dict[str, str]) -> str:
    if m := _BLOCK.match(name):
        layer, part, leaf = m.groups()
        if part in layer_names:
            return f"model.layers.{layer}.{layer_names[part]}.{leaf}"
    elif (m := _TOP.match(name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise UnsupportedModelError(f"GGUF tensor {name!r} has no mlx-lm counterpart")


def _upcast(t: mx.array) -> mx.array:
    # NOTE: float16 scales/biases and activations are slow on MLX's CPU backend; keep float32.
    return t.astype(mx.float32) if t.dtype in (mx.float16, mx.bfloat16) else t


def _unpermute_qk(weights: dict[str, mx.array], config: dict[str, Any]) -> None:
    """Undo llama.cpp's per-head row interleave of Q and K (its rope pairs rows (i, i+d/2))."""
    for name in list(weights):
        if ".self_attn.q_proj." in name:
            heads = config["num_attention_heads"]
        elif ".self_attn.k_proj." in name:
            heads = config["num_key_value_heads"]
        else:
            continue
        t = weights[name]
        rows = t.shape[0]
        # GGUF row (h, i, j) holds HF row (h, j, i) for i < d/2, j < 2.
        weights[name] = t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _quantize_like(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Quantize exactly the modules whose GGUF tensors arrived quantized, with their own layout."""
    layouts: dict[str, dict[str, int]] = {}
    for name, w in weights.items():
        if not name.endswith(".weight") or w.dtype != mx.uint32:
            continue
        prefix = name[: -len(".weight")]
        scales = weights.get(prefix + ".scales")
        if scales is None:
            raise ModelLoadError(f"quantized GGUF tensor {name!r} has no scales")
        # Every GGUF type read as a triple has groups of 32 (K-quants: 8 to a super-block).
        in_features = scales.shape[-1] * GROUP_SIZE
        layouts[prefix] = {"group_size": GROUP_SIZE, "bits": w.shape[-1] * 32 // in_features}

    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        return layouts.get(path, False)

    nn.quantize(model, class_predicate=predicate)
