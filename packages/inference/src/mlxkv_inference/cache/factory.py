"""Per-layer cache construction from the model's layer kinds and the KV scheme."""

from __future__ import annotations

import mlx.nn as nn

from mlxkv_inference import _mlx_lm
from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_inference.cache.quantized import QuantizedKVCache
from mlxkv_inference.cache.recurrent import RecurrentCache
from mlxkv_inference.errors import UnsupportedModelError
from mlxkv_inference.kv_scheme import KvScheme

LayerCache = PlainKVCache | RotatingKVCache | QuantizedKVCache | RecurrentCache


def make_caches(model: nn.Module) -> list[LayerCache]:
    """Sliding-window layers get rotating caches, linear-attention/SSM layers recurrent ones,
    full attention plain KV (converted to quantized by `maybe_quantize` under a KV-bits scheme)."""
    caches: list[LayerCache] = []
    for kind, params in _mlx_lm.describe_model_caches(model):
        if kind == "plain":
            caches.append(PlainKVCache())
        elif kind == "rotating":
            caches.append(RotatingKVCache(params["max_size"], params["keep"]))
        elif kind == "recurrent":
            caches.append(RecurrentCache(params["size"]))
        else:
            raise UnsupportedModelError(
                f"the model uses mlx-lm cache {kind!r}, which mlxkv cannot identify; "
                "supported: KVCache, RotatingKVCache, ArraysCache"
            )
    return caches


def maybe_quantize(caches: list[LayerCache], scheme: KvScheme) -> None:
    """Convert plain caches that reached the scheme's start offset to quantized ones, in place.

    NOTE: runs after every model call, like mlx-lm's `maybe_quantize_kv_cache`, so the tokens of
    the call that crossed the start were attended in full precision in both implementations.
    Rotating caches stay in full precision (mlx-lm cannot quantize them either).
    """
    if scheme.bits is None:
        return
    for i, cache in enumerate(caches):
        if isinstance(cache, PlainKVCache) and cache.offset >= scheme.quantized_start:
            caches[i] = QuantizedKVCache.from_plain(cache, scheme.group_size, scheme.bits)

