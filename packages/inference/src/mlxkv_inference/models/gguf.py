"""GGUF -> mlx-lm llama model.

`mx.load` returns GGUF's Q4_0/Q4_1/Q8_0 tensors as MLX affine triples (weight, scales, biases)
and the metadata. This module maps GGUF tensor names to mlx-lm's, undoes the Q/K row permutation
llama.cpp applies for its rope layout, and quantizes the model's layers to match each triple.
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

SUPPORTED_ARCHITECTURES = ("llama",)
# GGUF tensor types MLX's loader returns as affine-quantized triples, and the plain float types.
SUPPORTED_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0"}
GGUF_BLOCK_SIZE = 32

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
    """A llama model built from a GGUF file, with the metadata the tokenizer needs."""

    model: nn.Module
    config: dict[str, Any]
    metadata: dict[str, Any]


def load_gguf(path: Path) -> GgufModel:
    """Load a llama-architecture GGUF file into mlx-lm's llama model (float32 activations)."""
    try:
        weights, metadata = _mlx_lm.load_gguf_file(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    config = gguf_config(metadata, weights)
    mapped = {_map_name(name): _upcast(t) for name, t in weights.items()}
    _unpermute_qk(mapped, config)
    model = _mlx_lm.build_model(config)
    _quantize_like(model, mapped)
    model.load_weights(list(mapped.items()), strict=True)
    _mlx_lm.eval_parameters(model)
    model.eval()
    return GgufModel(model=model, config=config, metadata=metadata)


def gguf_config(metadata: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    """mlx-lm llama config from `llama.*` metadata; raises on unsupported features."""
    arch = str(metadata.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    file_type = _scalar(metadata, "general.file_type", default=-1)
    if file_type not in SUPPORTED_FILE_TYPES:
        names = ", ".join(SUPPORTED_FILE_TYPES.values())
        raise UnsupportedModelError(f"GGUF file type {file_type} is not supported; supported: {names}")
    if "llama.rope.scaling.type" in metadata or "rope_freqs.weight" in weights:
        raise UnsupportedModelError("GGUF rope scaling is not supported (plain llama rope only)")
    heads = int(_scalar(metadata, "llama.attention.head_count"))
    hidden = int(_scalar(metadata, "llama.embedding_length"))
    head_dim = int(_scalar(metadata, "llama.attention.key_length", default=hidden // heads))
    vocab = int(_scalar(metadata, "llama.vocab_size", default=len(metadata.get("tokenizer.ggml.tokens", []))))
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(metadata, "llama.block_count")),
        "intermediate_size": int(_scalar(metadata, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(metadata, "llama.attention.head_count_kv", default=heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_scalar(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "rope_theta": float(_scalar(metadata, "llama.rope.freq_base", default=10000.0)),
        "max_position_embeddings": int(_scalar(metadata, "llama.context_length", default=2048)),
        "tie_word_embeddings": "output.weight" not in weights,
    }


def _scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    if key not in metadata:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}")
        return default
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def _map_name(name: str) -> str:
    if m := _BLOCK.match(name):
        layer, part, leaf = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{leaf}"
    elif (m := _TOP.match(name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise UnsupportedModelError(f"GGUF tensor {name!r} has no llama counterpart")


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
        # GGUF's Q4_0, Q4_1 and Q8_0 blocks all hold 32 values: one block is one MLX group.
        in_features = scales.shape[-1] * GGUF_BLOCK_SIZE
        layouts[prefix] = {"group_size": GGUF_BLOCK_SIZE, "bits": w.shape[-1] * 32 // in_features}

    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        return layouts.get(path, False)

    nn.quantize(model, class_predicate=predicate)
