"""A whole llama-style decoder layer as one native node, on the native path.

With the native kernels a layer is still ~11 MLX graph nodes (two norms, four products, attention,
SwiGLU, two residual adds), and MLX's CPU backend spends a fixed dispatch on each, a large share
of a small model's decode step. `use_native_layers` gives mlx-lm's llama `TransformerBlock` a
forward that runs the same kernels in the same order inside one node (csrc/primitive.h
`decoder_layer`): the same bits as the separate nodes (tests/test_native_layer.py pins it), so
nothing in the config fingerprint changes. Qwen3's blocks too (their q and k normed per head before
RoPE, inside the node), and layers whose linears carry LoRA adapters for some rows
(native/low_rank.py: each row's delta inside the node). A layer or a cache the fused node does not
serve (DoRA, biases, norms of different eps, a RoPE variant the kernel does not know, rotating or
quantized caches) runs as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference.adapters.delta import AdaptedLinear
from mlxkv_inference.native.kernels import NativeQuantizedLinear
from mlxkv_inference.mixins import mix_into
from mlxkv_inference.native.attention import (
    KernelRope,
    first_positions,
    head_dim,
    keep_written,
    kernel_rope,
    native_sequence,
    uses_native_attention,
)
from mlxkv_inference.native.low_rank import LayerDeltas, layer_deltas
from mlxkv_inference.native.mlp import NativeSwigluMixin
from mlxkv_inference.native.norm import NativeRmsNormMixin

__all__ = ["fused_forward", "separate_layers", "use_native_layers"]

# mlx-lm blocks whose forward is h = x + attn(norm(x)); out = h + mlp(norm(h)).
_BLOCKS = (("mlx_lm.models.llama", "TransformerBlock"), ("mlx_lm.models.qwen3", "TransformerBlock"))


class NativeLayerMixin:
    """Mixed into mlx-lm's llama and qwen3 `TransformerBlock`: the layer as one native node where
    its modules and the cache allow it."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        # NOTE: the mask is causal (see NativeAttentionMixin): the kernel applies it itself.
        fused = fused_forward(self, x, [cache], [x.shape[1]]) if x.shape[0] == 1 else None
        if fused is None:
            out: mx.array = super().__call__(x, mask=mask, cache=cache)  # type: ignore[misc]
            return out
        return fused


def fused_forward(layer: Any, h: mx.array, caches: Sequence[Any], rows: Sequence[int]) -> mx.array | None:
    """The layer's output for the rows of `h` (cache i's sequence owns the next `rows[i]`), its
    new keys and values kept in the caches; None (nothing done) where the fused node does not
    serve this layer or one of the caches."""
    parts = _fused_parts(layer) if isinstance(layer, NativeLayerMixin) else None
    if parts is None or h.dtype != mx.float32:
        return None
    found = [native_sequence(cache, n) for cache, n in zip(caches, rows, strict=True)]
    sequences = [s for s in found if s is not None]
    if len(sequences) < len(found):
        return None
    attn, rope, linears, quant = parts
    adapted = _adapted_linears(layer)
    deltas = _deltas(layer, adapted, sum(rows)) if adapted else ([], [], [], [])
    if deltas is None:
        return None
    buffers = [b for s in sequences for b in s.buffers(attn.n_kv_heads, head_dim(attn))]
    weights = [linear[name] for linear in linears for name in ("weight", "scales", "biases")]
    from mlxkv_cpu_kernels import ops

    head_norms = [attn.q_norm["weight"], attn.k_norm["weight"]] if hasattr(attn, "q_norm") else []
    out, *written = ops.decoder_layer(
        h, layer.input_layernorm["weight"], layer.post_attention_layernorm["weight"], layer.input_layernorm.eps,
        weights, [bits for bits, _ in quant], [group for _, group in quant], head_norms, first_positions(sequences), buffers,
        list(rows), attn.scale, inv_freq=rope.inv_freq, rope_dims=rope.dims, rope_traditional=rope.traditional,
        rope_scale=rope.scale, low_ranks=deltas[0], low_rank_products=deltas[1], low_rank_scales=deltas[2],
        low_rank_rows=deltas[3])
    keep_written(sequences, written)
    return out


def use_native_layers(model: nn.Module) -> bool:
    """Gives every llama `TransformerBlock` of `model` whose modules the fused node serves (call it
    after the native kernels, attention, SwiGLU and RMS norm are in) the one-node forward;
    returns whether any layer got it."""
    return mix_into(model, _BLOCKS, NativeLayerMixin, "Native", where=lambda layer: _fused_parts(layer) is not None)


def separate_layers(model: nn.Module) -> int:
    """Undoes `use_native_layers`: each layer runs its modules as separate nodes again (the same
    bits; `tools.bench_decode --cpu-kernels native` times both). Returns how many layers changed."""
    changed = 0
    for _, module in model.named_modules():  # type: ignore[no-untyped-call]  # mlx leaves it untyped
        if isinstance(module, NativeLayerMixin):
            module.__class__ = next(base for base in type(module).__bases__ if base is not NativeLayerMixin)
            changed += 1
    return changed


_Parts = tuple[Any, KernelRope, list[Any], list[tuple[int, int]]]
_LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
            ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _adapted_linears(layer: Any) -> list[tuple[int, AdaptedLinear]]:
    """The layer's linears adapting rows in this step (swapped in by the adapter bank), by index."""
    found = ((index, layer[block][name]) for index, (block, name) in enumerate(_LINEARS))
    return [(index, module) for index, module in found if isinstance(module, AdaptedLinear)]


def _deltas(layer: Any, adapted: list[tuple[int, AdaptedLinear]], rows: int) -> LayerDeltas | None:
    """The step's LoRA deltas on the adapted linears (None: one the fused node cannot add), kept
    beside the layer while the adapter bank's plan lasts (a batch keeps it for many steps)."""
    key = (adapted[0][1].plan, rows, [wrapper for _, wrapper in adapted])
    cached: tuple[Any, int, list[AdaptedLinear], LayerDeltas | None] | None = getattr(layer, "_mlxkv_deltas", None)
    if cached is not None and cached[0] is key[0] and cached[1] == rows and len(cached[2]) == len(key[2]) \
            and all(a is b for a, b in zip(cached[2], key[2])):
        return cached[3]
    deltas = _derive_deltas(adapted, rows)
    object.__setattr__(layer, "_mlxkv_deltas", (*key, deltas))  # not a parameter: beside the module tree
    return deltas


def _derive_deltas(adapted: list[tuple[int, AdaptedLinear]], rows: int) -> LayerDeltas | None:
    found = []
    for index, wrapper in adapted:
        row_deltas = wrapper.row_deltas(rows)
        if row_deltas is None:
            return None
        found.append((index, row_deltas))
    return layer_deltas(found)


def _fused_parts(layer: Any) -> _Parts | None:
    """(attention, its RoPE as the kernel applies it, the seven linears q k v o gate up down (an
    adapted one's base layer), (bits, group size) of q/k/v, o, gate/up and down) when the fused
    node computes exactly what the layer's modules do; worked out once per set of modules (not
    every step) and again when one is swapped (an adapter)."""
    # Modules are dicts of their children: item lookups, a fraction of attribute lookups' cost.
    attn, mlp = layer["self_attn"], layer["mlp"]
    modules = (layer["input_layernorm"], layer["post_attention_layernorm"], attn, mlp, attn["q_proj"], attn["k_proj"],
               attn["v_proj"], attn["o_proj"], mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"])
    cached: tuple[tuple[Any, ...], _Parts | None] | None = getattr(layer, "_mlxkv_fused_parts", None)
    if cached is not None and len(cached[0]) == len(modules) and all(a is b for a, b in zip(cached[0], modules)):
        return cached[1]
    parts = _parts_of(*modules)
    object.__setattr__(layer, "_mlxkv_fused_parts", (modules, parts))  # not a parameter: beside the module tree
    return parts


def _parts_of(input_norm: Any, post_norm: Any, attn: Any, mlp: Any, *modules: Any) -> _Parts | None:
    norms: list[Any] = [input_norm, post_norm]
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):  # Qwen3: each head of q and k normed before RoPE
        norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if not all(isinstance(n, NativeRmsNormMixin) for n in norms) or len({n.eps for n in norms}) > 1 \
            or not all(n.weight.dtype == mx.float32 for n in norms):
        return None
    rope = kernel_rope(attn.rope)
    if not uses_native_attention(attn) or rope is None or not isinstance(mlp, NativeSwigluMixin):
        return None
    linears = [m.base if isinstance(m, AdaptedLinear) else m for m in modules]
    if not all(type(linear) is NativeQuantizedLinear and "bias" not in linear for linear in linears):
        return None
    groups = (linears[0:3], linears[3:4], linears[4:6], linears[6:7])
    if any(len({(m.bits, m.group_size, m["scales"].dtype) for m in group}) > 1 for group in groups):
        return None
    return attn, rope, linears, [(group[0].bits, group[0].group_size) for group in groups]
