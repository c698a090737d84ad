"""A batched decode step over mlx-lm's llama-style graphs (and Gemma 3's: native/gemma_block.py).

    rows  t0 t1 ... t(R-1)                 L_i consecutive tokens of sequence i (1, a
                                           speculative round's pending token and drafts, or a
                                           prompt's rest with its first decode step)
    embed, norms, q/k/v/o projections, MLP: one (R, 1, D) product per weight (native: q, k
                                           and v in one kernel call, gate and up in one)
    final norm, lm_head:                   the rows whose logits are asked for (`logits_of`)
    RoPE, cache update, attention:        per sequence, its L_i positions against its own
                                           cache (no padding), as its own forward runs them;
                                           with native attention one kernel call a layer for
                                           all sequences (native/attention.py)
    all of a layer, natively:              one node (native/layer.py), the same bits

Every batched operation is row-wise (a row's result depends on that row only) when the matmul
kernels are row-invariant; `row_invariant_kinds` checks that per weight kind, and a step whose
weights are not falls back to one graph per row (see `BatchedDecoder`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference import _mlx_lm
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.native.graphs import can_batch
from mlxkv_inference.native.kernels import project
from mlxkv_inference.native.attention import NativeSequence, attend_rows, native_sequence, uses_native_attention
from mlxkv_inference.native.gemma_block import gemma_embed, gemma_layer, is_gemma3
from mlxkv_inference.native.layer import fused_forward

# Layers built between two `async_eval`s of the step's hidden state: the first layers' kernels run
# while Python builds the rest, and MLX never blocks that Python on its dispatch limit. Same values either way.
LAYERS_PER_DISPATCH = 4


def rows_invariant(model: nn.Module, max_rows: int, checked: int = 1) -> bool:
    """Whether every matmul the batched step runs (each distinct kind and shape of projection,
    and the head) gives each row of an M-row product, for M = `checked` + 1..`max_rows` (smaller
    M probed already), bitwise what that row gives alone. (The embedding is a gather, the norms
    and activations are row-wise.)"""
    inner: Any = getattr(model, "model")
    layer = inner.layers[0]
    linears: dict[tuple[str, tuple[int, ...]], Any] = {}
    for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   *_mlp_linears(layer.mlp), getattr(model, "lm_head", None)):
        if module is not None:
            linears.setdefault((type(module).__name__, tuple(module.weight.shape)), module)
    heads: list[Any] = [*linears.values()]
    if getattr(model, "lm_head", None) is None:
        heads.append(inner.embed_tokens.as_linear)
    for index, linear in enumerate(heads):
        width = _input_width(linear, inner)
        x = mx.random.normal((max_rows, 1, width), key=mx.random.key(index))
        alone = mx.concatenate([linear(x[r : r + 1]) for r in range(max_rows)])
        for m in range(max(checked + 1, 2), max_rows + 1):
            if not mx.array_equal(linear(x[:m]), alone[:m]).item():  # one sync an M, not one a row
                return False
    return True


def decode_batch(model: nn.Module, tokens: mx.array, caches: Sequence[Sequence[LayerCache]],
                 lengths: Sequence[int] | None = None, logits_of: Sequence[int] | None = None) -> mx.array:
    """float32 logits: sequence i feeds the next `lengths[i]` tokens (default one each) into
    `caches[i]`; the logits of its last `logits_of[i]` rows (default all), sequence by sequence
    (a prompt fed with its first decode step needs its last position's alone: the head over
    the other positions would cost a fifth of the step)."""
    spans = _spans(lengths if lengths is not None else [1] * len(caches))
    inner: Any = getattr(model, "model")
    gemma = is_gemma3(inner)
    h: mx.array = gemma_embed(inner, tokens) if gemma else inner.embed_tokens(tokens.reshape(-1, 1))
    for index, layer in enumerate(inner.layers):
        layer_caches = [row[index] for row in caches]
        fused = None if gemma else fused_forward(layer, h, layer_caches, [b - a for a, b in spans])
        if gemma:
            h = gemma_layer(layer, h, layer_caches, spans, inner.window_size)
        elif fused is not None:
            h = fused
        else:
            h = h + _attention(layer.self_attn, layer.input_layernorm(h), layer_caches, spans)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if index % LAYERS_PER_DISPATCH == LAYERS_PER_DISPATCH - 1 and index + 1 < len(inner.layers):
            _mlx_lm.async_eval(h)  # these layers run while the next ones are built (the caller evaluates the rest)
    if logits_of is not None:
        kept = [r for (a, b), n in zip(spans, logits_of, strict=True) for r in range(max(b - n, a), b)]
        if len(kept) < h.shape[0]:
            h = h[mx.array(kept)]  # row-wise from here on: each kept row as in the whole batch
    h = inner.norm(h)
    head: Any = getattr(model, "lm_head", None)
    logits: mx.array = inner.embed_tokens.as_linear(h) if head is None else head(h)
    logits = logits[:, -1, :]
    return logits if logits.dtype == mx.float32 else logits.astype(mx.float32)


def _mlp_linears(mlp: Any) -> list[Any]:
    return [getattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj") if hasattr(mlp, name)]


def _input_width(linear: Any, inner: Any) -> int:
    """Input features of a linear layer (quantized weights pack several values per uint32)."""
    if not hasattr(linear, "weight"):  # the tied head: embeddings as a linear layer
        return int(inner.embed_tokens.weight.shape[1] * (32 // getattr(inner.embed_tokens, "bits", 32)))
    bits = getattr(linear, "bits", 32)
    return int(linear.weight.shape[1] * (32 // bits))


def _spans(lengths: Sequence[int]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for length in lengths:
        if length < 1:
            raise ValueError(f"a sequence feeds at least one token a step, not {length}")
        spans.append((start, start + length))
        start += length
    return spans


def _attention(attn: Any, x: mx.array, caches: list[LayerCache], spans: Sequence[tuple[int, int]]) -> mx.array:
    if uses_native_attention(attn):
        sequences = [native_sequence(cache, b - a) for (a, b), cache in zip(spans, caches, strict=True)]
        if all(s is not None for s in sequences):
            native: mx.array = attn.o_proj(attend_rows(attn, x, [s for s in sequences if s is not None]))
            return native
        if any(s is not None for s in sequences):
            return _mixed_attention(attn, x, caches, spans, sequences)
    queries, keys, values = project(x, [attn.q_proj, attn.k_proj, attn.v_proj])
    outputs = [_sequence_attention(attn, queries[a:b], keys[a:b], values[a:b], cache)
               for (a, b), cache in zip(spans, caches, strict=True)]
    out: mx.array = attn.o_proj(mx.concatenate(outputs, axis=0))
    return out


def _mixed_attention(attn: Any, x: mx.array, caches: list[LayerCache], spans: Sequence[tuple[int, int]],
                     sequences: Sequence[NativeSequence | None]) -> mx.array:
    """Rows whose caches the native kernel serves attend through it together, the others through
    mlx-lm's attention body, each as it would alone (a cache that has switched kind, e.g. to
    quantized KV, next to plain ones)."""
    native_rows = [r for (a, b), s in zip(spans, sequences) if s is not None for r in range(a, b)]
    other_rows = [r for (a, b), s in zip(spans, sequences) if s is None for r in range(a, b)]
    native = attend_rows(attn, x[mx.array(native_rows)], [s for s in sequences if s is not None])
    other = x[mx.array(other_rows)]  # row-invariant projections: each row as in the whole batch
    queries, keys, values = project(other, [attn.q_proj, attn.k_proj, attn.v_proj])
    outputs, at_native, at_other = [], 0, 0
    for (a, b), cache, sequence in zip(spans, caches, sequences, strict=True):
        if sequence is None:
            end = at_other + b - a
            outputs.append(_sequence_attention(attn, queries[at_other:end], keys[at_other:end], values[at_other:end],
                                               cache))
            at_other = end
        else:
            outputs.append(native[at_native : at_native + b - a])
            at_native += b - a
    out: mx.array = attn.o_proj(mx.concatenate(outputs, axis=0))
    return out


def _sequence_attention(attn: Any, q: mx.array, k: mx.array, v: mx.array, cache: Any) -> mx.array:
    """mlx-lm's attention body for one sequence's (L, 1, D) rows as its (1, L, D) positions
    (qwen3's q/k norms included)."""
    length = q.shape[0]
    q = q.reshape(1, length, attn.n_heads, -1)
    k = k.reshape(1, length, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    v = v.reshape(1, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    offset = cache.offset
    q, k = attn.rope(q, offset=offset), attn.rope(k, offset=offset)
    mask = _mlx_lm.create_attention_mask(q[:, 0], cache)
    keys, values = cache.update_and_fetch(k, v)
    out = _mlx_lm.attention(q, keys, values, cache, attn.scale, mask)
    return out.transpose(0, 2, 1, 3).reshape(length, 1, -1)
