"""Which mlx-lm graphs the batched step (`native/batched.py`) and the native layers drive: llama-style
layers, full attention, no recurrent cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.nn as nn

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.recurrent import RecurrentCache

__all__ = ["BATCHABLE_MODEL_TYPES", "can_batch"]

# Graphs whose layers are (input norm, self_attn, post norm, mlp) with q/k/v/o projections.
BATCHABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def can_batch(model: nn.Module, config: dict[str, Any], caches: Sequence[Sequence[LayerCache]]) -> bool:
    """Whether `decode_batch` can drive this model with these caches."""
    if config.get("model_type") not in BATCHABLE_MODEL_TYPES:
        return False
    if any(t != "full_attention" for t in (config.get("layer_types") or ())):
        return False
    inner: Any = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        return False
    return not any(isinstance(c, RecurrentCache) for row in caches for c in row)
