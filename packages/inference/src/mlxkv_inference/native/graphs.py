"""Which mlx-lm graphs the batched step (`native/batched.py`) and the native layers drive: llama-style
layers with full attention (both), Gemma 3 (the batched step); no recurrent cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.nn as nn

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.recurrent import RecurrentCache

__all__ = ["GEMMA3_TYPES", "LLAMA_STYLE_TYPES", "can_batch", "llama_style"]

# Graphs whose layers are (input norm, self_attn, post norm, mlp) with q/k/v/o projections.
LLAMA_STYLE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Gemma 3's (four norms a layer, sliding-window layers between global ones: native/gemma_block.py).
GEMMA3_TYPES = frozenset({"gemma3_text"})


def llama_style(config: dict[str, Any]) -> bool:
    """Whether the model's layers are llama-style, full attention (what the native attention
    kernel and the fused layer serve)."""
    return config.get("model_type") in LLAMA_STYLE_TYPES and all(
        t == "full_attention" for t in (config.get("layer_types") or ()))


def can_batch(model: nn.Module, config: dict[str, Any], caches: Sequence[Sequence[LayerCache]]) -> bool:
    """Whether `decode_batch` can drive this model with these caches."""
    if not (llama_style(config) or config.get("model_type") in GEMMA3_TYPES):
        return False
    inner: Any = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        return False
    return not any(isinstance(c, RecurrentCache) for row in caches for c in row)
