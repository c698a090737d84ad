"""Attention through mlxkv-cpu-kernels' fixed-order kernel, on the native path.

`use_native_attention` gives each attention layer of a batchable (llama-style) float32 model a
subclass whose forward runs `attend_rows`: projections, q/k norms and RoPE as mlx-lm computes
them, then one native call that writes the new keys and values into the sequence's buffers and
attends causally. Every forward of such a model goes through it (prefill chunks, the compiled
decode step, speculative verification, the batched step), and a row's output depends on its
query and its keys alone (csrc/attention.h), so those forwards agree bit for bit. Caches the
kernel does not serve (rotating, quantized) keep mlx-lm's attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.cache.stand_ins import PlainKvStandIn
from mlxkv_inference.native.graphs import can_batch, llama_style
from mlxkv_inference.native.kernels import float32_activations, project

__all__ = ["attend_rows", "first_positions", "head_dim", "keep_written", "native_sequence", "uses_native_attention", "use_native_attention"]

NATIVE_ATTENTION = "attention native/2"  # what the config fingerprint records (see binding.config_fingerprint)
_MAX_HEAD_DIM = 256
_MAX_GROUP = 64  # query heads per kv head (the kernel's limit)


class NativeSequence:
    """One sequence's KV as the kernel sees it: buffers with room for `rows` more positions,
    where they start, and how to keep what the kernel returns."""

    def __init__(self, cache: PlainKVCache | PlainKvStandIn, rows: int) -> None:
        self.cache = cache
        self.rows = rows

    def position(self) -> mx.array | int:
        return self.cache.write_index.reshape(1) if isinstance(self.cache, PlainKvStandIn) else self.cache.offset

    def buffers(self, heads: int, dim: int) -> list[mx.array]:
        cache = self.cache
        if isinstance(cache, PlainKVCache):
            cache.reserve(self.rows, heads, dim, dim, mx.float32)
        assert cache.keys is not None and cache.values is not None
        return [cache.keys, cache.values]

    def keep(self, keys: mx.array, values: mx.array) -> None:
        self.cache.keys, self.cache.values = keys, values
        if isinstance(self.cache, PlainKVCache):
            self.cache.offset += self.rows


def native_sequence(cache: Any, rows: int) -> NativeSequence | None:
    """The kernel's view of `cache` feeding `rows` positions; None where mlx-lm's attention runs
    (rotating or quantized caches, buffers of another dtype)."""
    if not isinstance(cache, PlainKVCache | PlainKvStandIn):
        return None
    return NativeSequence(cache, rows) if cache.keys is None or cache.keys.dtype == mx.float32 else None


def attend_rows(attn: Any, x: mx.array, sequences: Sequence[NativeSequence]) -> mx.array:
    """Attention output (before o_proj) for the rows of `x` (leading dims flattened, feature dim
    last), shaped as `x` with the heads' outputs as features: sequence i owns the next
    `sequences[i].rows` rows, its consecutive positions."""
    queries, keys, values = project(x, [attn.q_proj, attn.k_proj, attn.v_proj])
    known_rope = kernel_rope(attn.rope)
    firsts = first_positions(sequences)
    # The kernel reads q, k and v as rows of heads, so the projections go in as they come: no
    # per-head view (4 of a layer's ~15 graph nodes) unless a q/k norm or MLX's RoPE needs one.
    per_head = hasattr(attn, "q_norm") or known_rope is None
    if per_head:
        rows = sum(s.rows for s in sequences)
        queries = queries.reshape(rows, attn.n_heads, -1)
        keys, values = keys.reshape(rows, attn.n_kv_heads, -1), values.reshape(rows, attn.n_kv_heads, -1)
        if hasattr(attn, "q_norm"):
            queries, keys = attn.q_norm(queries), attn.k_norm(keys)
        if known_rope is None:  # a RoPE variant the kernel does not know: MLX rotates, one position per row
            positions = mx.concatenate([first + mx.arange(s.rows, dtype=mx.int32) for first, s in zip(firsts, sequences)])
            queries = attn.rope(queries[:, :, None, :], offset=positions)[:, :, 0, :]
            keys = attn.rope(keys[:, :, None, :], offset=positions)[:, :, 0, :]
    rope = known_rope or KernelRope(None, 0, False, 1.0)  # none: rotated already
    dim = queries.shape[-1] if per_head else queries.shape[-1] // attn.n_heads
    buffers = [b for s in sequences for b in s.buffers(attn.n_kv_heads, dim)]
    from mlxkv_cpu_kernels import ops

    out, *written = ops.attend(queries, keys, values, firsts, buffers, [s.rows for s in sequences], attn.scale,
                               inv_freq=rope.inv_freq, rope_dims=rope.dims, rope_traditional=rope.traditional,
                               rope_scale=rope.scale)
    keep_written(sequences, written)
    return out.reshape(*x.shape[:-1], -1) if per_head else out


def first_positions(sequences: Sequence[NativeSequence]) -> mx.array:
    """int32 (S,): the absolute position of each sequence's first row, as the kernel takes them."""
    starts = [s.position() for s in sequences]
    if all(isinstance(p, int) for p in starts):
        return mx.array(starts, dtype=mx.int32)
    # the compiled step's stand-in: its position is an input array
    return mx.concatenate([mx.array([p]) if isinstance(p, int) else p for p in starts]).astype(mx.int32)


def keep_written(sequences: Sequence[NativeSequence], written: Sequence[mx.array]) -> None:
    """Each sequence keeps the (keys, values) buffers the kernel returns for it, in order."""
    for i, sequence in enumerate(sequences):
        sequence.keep(written[2 * i], written[2 * i + 1])


@dataclass(frozen=True)
class KernelRope:
    """RoPE as the kernel applies it: theta_i = (position * scale) * inv_freq[i]."""

    inv_freq: mx.array | None
    dims: int
    traditional: bool
    scale: float


def kernel_rope(rope: Any) -> KernelRope | None:
    """The kernel's form of mlx's `nn.RoPE` and mlx-lm's `Llama3RoPE` (cached on the module);
    None for other variants, which MLX applies before the kernel."""
    cached: KernelRope | None = getattr(rope, "_mlxkv_kernel_rope", None)
    if cached is not None:
        return cached
    dims = int(getattr(rope, "dims", 0))
    if type(rope) is nn.RoPE and rope.base is not None:
        inv_freq = 1.0 / (rope.base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
        scale = float(rope.scale)
    elif type(rope).__name__ == "Llama3RoPE" and getattr(rope, "_freqs", None) is not None:
        inv_freq, scale = 1.0 / rope._freqs.astype(mx.float32), 1.0
    else:
        return None
    mx.eval(inv_freq)
    found = KernelRope(inv_freq, dims, bool(rope.traditional), scale)
    object.__setattr__(rope, "_mlxkv_kernel_rope", found)
    return found


class NativeAttentionMixin:
    """Mixed into a model's attention class: the native kernel where the cache allows it."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        # NOTE: mlx-lm's mask for these caches is None, "causal" or the compiled step's stand-in's
        # `arange <= write`: all the causal attention the kernel does by itself.
        sequence = native_sequence(cache, x.shape[1]) if x.shape[0] == 1 else None
        if sequence is None:
            out: mx.array = super().__call__(x, mask=mask, cache=cache)  # type: ignore[misc]
            return out
        attn: Any = self
        result: mx.array = attn.o_proj(attend_rows(attn, x, [sequence]))
        return result


def use_native_attention(model: nn.Module, config: dict[str, Any]) -> bool:
    """Gives every attention layer of `model` the native kernel, where the model is one it
    serves (llama-style layers, float32 activations, head size a multiple of 16 up to 256, at
    most 64 query heads per kv head);
    returns whether it did."""
    inner: Any = getattr(model, "model", None)
    if not (llama_style(config) and can_batch(model, config, [])) or inner is None:
        return False
    layers = list(inner.layers)
    attn = layers[0].self_attn
    dim = head_dim(attn)
    if not float32_activations(model) or dim % 16 or dim > _MAX_HEAD_DIM or attn.n_heads % attn.n_kv_heads \
            or attn.n_heads // attn.n_kv_heads > _MAX_GROUP:
        return False
    classes: dict[type, type] = {}
    for layer in layers:
        cls = type(layer.self_attn)
        if cls not in classes:
            classes[cls] = type(f"Native{cls.__name__}", (NativeAttentionMixin, cls), {})
        layer.self_attn.__class__ = classes[cls]
    return True


def uses_native_attention(attn: Any) -> bool:
    """Whether an attention layer runs the native kernel (see `use_native_attention`)."""
    return isinstance(attn, NativeAttentionMixin)


def head_dim(attn: Any) -> int:
    # q_proj's weight is (heads * head size, features), packed along features only.
    return int(getattr(attn, "head_dim", None) or attn.q_proj.weight.shape[0] // attn.n_heads)
