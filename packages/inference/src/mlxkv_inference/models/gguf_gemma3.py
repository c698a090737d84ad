"""The `gemma3` GGUF architecture -> mlx-lm's `gemma3_text` config and weight names.

Two conventions differ from llama's: llama.cpp's converter stores Gemma's RMSNorm weights with
1 added (its norm multiplies by the weight; mlx-lm's adds 1 at run time), and it does not permute
Q and K (Gemma's rope is the NeoX layout mlx-lm uses). What the GGUF does not say, llama.cpp
hard-codes for gemma3 and so do we: every sixth layer global, local rope base 10,000, attention
scale 1/sqrt(head size) (hidden / heads for the 62-layer 27B).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv_inference.models.gguf_reader import scalar

__all__ = ["GEMMA3_LAYER_NAMES", "gemma3_config", "unshift_norms"]

GEMMA3_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SLIDING_WINDOW_PATTERN = 6
_LOCAL_ROPE_BASE = 10000.0
_LAYERS_27B = 62


def gemma3_config(metadata: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    """mlx-lm `gemma3_text` config from `gemma3.*` metadata."""
    heads = int(scalar(metadata, "gemma3.attention.head_count"))
    hidden = int(scalar(metadata, "gemma3.embedding_length"))
    head_dim = int(scalar(metadata, "gemma3.attention.key_length", default=hidden // heads))
    layers = int(scalar(metadata, "gemma3.block_count"))
    config: dict[str, Any] = {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(scalar(metadata, "gemma3.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(scalar(metadata, "gemma3.attention.head_count_kv", default=heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(scalar(metadata, "gemma3.attention.layer_norm_rms_epsilon")),
        "vocab_size": len(metadata.get("tokenizer.ggml.tokens", [])) or int(weights["token_embd.scales"].shape[0]),
        "rope_theta": float(scalar(metadata, "gemma3.rope.freq_base", default=1_000_000.0)),
        "rope_local_base_freq": float(scalar(metadata, "gemma3.rope.freq_base_swa", default=_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": hidden // heads if layers == _LAYERS_27B else head_dim,
        "sliding_window": int(scalar(metadata, "gemma3.attention.sliding_window")),
        "sliding_window_pattern": _SLIDING_WINDOW_PATTERN,
        "max_position_embeddings": int(scalar(metadata, "gemma3.context_length", default=32768)),
        "tie_word_embeddings": "output.weight" not in weights,
    }
    if "gemma3.rope.scaling.factor" in metadata:  # the larger Gemma 3: linear scaling of the global layers
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(scalar(metadata, "gemma3.rope.scaling.factor"))}
    return config


def unshift_norms(weights: dict[str, mx.array]) -> None:
    """Subtract the 1 llama.cpp's converter added to every RMSNorm weight (in place). Exact for
    the stored values (bfloat16 sums held in float32), so mlx-lm's 1 + w gives them back bit for bit."""
    for name in list(weights):
        if name.endswith("norm.weight"):
            weights[name] = weights[name] - 1.0
