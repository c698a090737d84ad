"""The batched step's Gemma 3 layer: mlx-lm's `gemma3_text` block op for op on the step's rows.

Norms, projections and the MLP run on all rows at once (row-invariant kernels); RoPE, masks,
the cache update and attention run per sequence over its own caches (sliding-window rings or the
global layers' plain caches), as Gemma 3's forward runs them for that sequence alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv_inference import _mlx_lm
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.native.kernels import project

__all__ = ["is_gemma3", "gemma_embed", "gemma_layer"]


def is_gemma3(inner: Any) -> bool:
    """Whether `inner` (a model's `model`) is mlx-lm's Gemma 3 text model."""
    layers: Any = getattr(inner, "layers", None) or [None]
    return hasattr(inner, "sliding_window_pattern") and hasattr(layers[0], "pre_feedforward_layernorm")


def gemma_embed(inner: Any, tokens: mx.array) -> mx.array:
    """(rows, 1, hidden) embeddings of the step's tokens, scaled as Gemma 3 scales them."""
    h: mx.array = inner.embed_tokens(tokens.reshape(-1, 1))
    return h * mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)


def gemma_layer(layer: Any, h: mx.array, caches: Sequence[LayerCache], spans: Sequence[tuple[int, int]],
                window: int) -> mx.array:
    """One Gemma 3 block over the step's rows (sequence i owns rows spans[i])."""
    residual = _mlx_lm.gemma_residual(layer)
    r = _attention(layer.self_attn, layer.input_layernorm(h), caches, spans, window)
    h = residual(h, layer.post_attention_layernorm(r))
    r = layer.mlp(layer.pre_feedforward_layernorm(h))
    out: mx.array = residual(h, layer.post_feedforward_layernorm(r))
    return out


def _attention(attn: Any, x: mx.array, caches: Sequence[Any], spans: Sequence[tuple[int, int]],
               window: int) -> mx.array:
    queries, keys, values = project(x, [attn.q_proj, attn.k_proj, attn.v_proj])
    outputs = []
    for (a, b), cache in zip(spans, caches, strict=True):
        length = b - a
        q = queries[a:b].reshape(1, length, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = keys[a:b].reshape(1, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = values[a:b].reshape(1, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rope(q, offset=cache.offset), attn.rope(k, offset=cache.offset)
        mask = _mlx_lm.create_attention_mask(x[a:b].reshape(1, length, -1), cache, window if attn.is_sliding else None)
        fetched_keys, fetched_values = cache.update_and_fetch(k, v)
        out = _mlx_lm.attention(q, fetched_keys, fetched_values, cache, attn.scale, mask)
        outputs.append(out.transpose(0, 2, 1, 3).reshape(length, 1, -1))
    projected: mx.array = attn.o_proj(mx.concatenate(outputs, axis=0))
    return projected
