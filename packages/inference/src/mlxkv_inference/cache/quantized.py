"""Affine-quantized KV cache (4 or 8 bits), following mlx-lm's `QuantizedKVCache` arithmetic.

A plain cache converts to this kind once it reaches the scheme's start offset; the prefix before
the conversion point was attended in full precision by the run that built it, so no reuse may
trim below it (`minimum_reusable_offset`): a fresh run would compute that prefix differently.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv_inference.cache.contract import CacheTrimError, DecodePhase, DecodePlan
from mlxkv_inference.cache.kv import STEP, PlainKVCache, causal_mask
from mlxkv_inference.cache.stand_ins import QuantizedKvStandIn

Triple = tuple[mx.array, mx.array, mx.array]


class QuantizedKVCache:
    step = STEP

    def __init__(self, group_size: int = 64, bits: int = 8, *, converted_at: int = 0) -> None:
        if bits not in (4, 8):
            raise ValueError(f"quantized KV bits={bits} is not supported; allowed: 4, 8")
        self.group_size = group_size
        self.bits = bits
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.offset = 0
        self._converted_at = converted_at

    @classmethod
    def from_plain(cls, plain: PlainKVCache, group_size: int, bits: int) -> QuantizedKVCache:
        cache = cls(group_size, bits, converted_at=plain.offset)
        cache.offset = plain.offset
        if plain.keys is not None and plain.values is not None:
            cache.keys = _quantize(plain.keys, group_size, bits)
            cache.values = _quantize(plain.values, group_size, bits)
        return cache

    # -- mlx-lm cache interface -------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        prev = self.offset
        self._reserve(keys, values, keys.shape[2])
        assert self.keys is not None and self.values is not None
        self.offset += keys.shape[2]
        qk, qv = _quantize(keys, self.group_size, self.bits), _quantize(values, self.group_size, self.bits)
        for i in range(3):
            self.keys[i][..., prev : self.offset, :] = qk[i]
            self.values[i][..., prev : self.offset, :] = qv[i]
        return self._fetch()

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> Any:
        return causal_mask(n, self.offset, window_size, return_array)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))

    @property
    def state(self) -> tuple[Triple | None, Triple | None, int, int, int]:
        return self.keys, self.values, self.offset, self.group_size, self.bits

    # -- contract ------------------------------------------------------------------------
    @property
    def minimum_reusable_offset(self) -> int:
        return self._converted_at

    def signature(self) -> str:
        return "kv.quantized/1"

    def is_trimmable(self) -> bool:
        return self.offset > self._converted_at

    def trim(self, n: int, bypass: bool = False) -> int:
        if n < 0:
            raise ValueError(f"trim count must be >= 0, got {n}")
        if self.offset - n < self._converted_at:
            raise CacheTrimError(
                f"cannot trim {n} tokens: the cache was quantized at token {self._converted_at} "
                f"(offset {self.offset}); no reuse may go below the conversion point"
            )
        self.offset -= n
        return n

    def bytes_per_token(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(a.shape[0] * a.shape[1] * a.shape[3] * a.itemsize for a in (*self.keys, *self.values))

    def decode_phase(self) -> DecodePhase:
        return "concat"

    def prepare_decode_step(self, rows: int = 1) -> DecodePlan | None:
        if self.keys is None or self.values is None or rows != 1:
            return None
        self._reserve_like_buffers(1)
        assert self.keys is not None
        return DecodePlan("concat", self.keys[0].shape[2], self.offset, self.offset)

    def decode_stand_in(self, plan: DecodePlan) -> QuantizedKvStandIn:
        return QuantizedKvStandIn(plan, self.group_size, self.bits)

    def decode_inputs(self, plan: DecodePlan) -> list[mx.array]:
        assert self.keys is not None and self.values is not None
        position = mx.array(plan.offset, dtype=mx.int32)
        return [*self.keys, *self.values, position, position]

    def commit_decode_step(self, plan: DecodePlan, outputs: list[mx.array]) -> None:
        self.keys = (outputs[0], outputs[1], outputs[2])
        self.values = (outputs[3], outputs[4], outputs[5])
        self.offset = plan.offset + 1

    def dispose(self) -> None:
        self.keys = self.values = None
        self.offset = 0

    def clone(self) -> QuantizedKVCache:
        other = QuantizedKVCache(self.group_size, self.bits, converted_at=self._converted_at)
        other.offset = self.offset
        if self.keys is not None and self.values is not None:
            other.keys = (self.keys[0][...], self.keys[1][...], self.keys[2][...])
            other.values = (self.values[0][...], self.values[1][...], self.values[2][...])
        return other

    def compact(self) -> None:
        """Hold the tokens in buffers of exactly `offset` positions, owned by this cache alone."""
        if self.keys is not None and self.values is not None:
            n = self.offset
            self.keys = (_owned(self.keys[0], n), _owned(self.keys[1], n), _owned(self.keys[2], n))
            self.values = (_owned(self.values[0], n), _owned(self.values[1], n), _owned(self.values[2], n))

    # -- helpers -----------------------------------------------------------------------------
    def _reserve(self, keys: mx.array, values: mx.array, n: int) -> None:
        if self.keys is not None and self.offset + n <= self.keys[0].shape[2]:
            return
        if self.keys is not None:
            self._reserve_like_buffers(n)
            return
        b, heads, _, k_dim = keys.shape
        shape = (b, heads, (self.step + n - 1) // self.step * self.step)
        self.keys = _empty_triple(shape, k_dim, keys.dtype, self.group_size, self.bits)
        self.values = _empty_triple(shape, values.shape[3], values.dtype, self.group_size, self.bits)

    def _reserve_like_buffers(self, n: int) -> None:
        assert self.keys is not None and self.values is not None
        prev = self.offset
        if prev + n <= self.keys[0].shape[2]:
            return
        new_steps = (self.step + n - 1) // self.step * self.step

        def expand(x: mx.array) -> mx.array:
            if prev % self.step != 0:
                x = x[..., :prev, :]
            return mx.concatenate([x, mx.zeros((*x.shape[:2], new_steps, x.shape[3]), x.dtype)], axis=2)

        self.keys = (expand(self.keys[0]), expand(self.keys[1]), expand(self.keys[2]))
        self.values = (expand(self.values[0]), expand(self.values[1]), expand(self.values[2]))

    def _fetch(self) -> tuple[Triple, Triple]:
        assert self.keys is not None and self.values is not None
        if self.offset == self.keys[0].shape[2]:
            return self.keys, self.values
        k, v, o = self.keys, self.values, self.offset
        return (k[0][..., :o, :], k[1][..., :o, :], k[2][..., :o, :]), (v[0][..., :o, :], v[1][..., :o, :], v[2][..., :o, :])


def _owned(a: mx.array, n: int) -> mx.array:
    return mx.contiguous(a[..., :n, :])  # a slice alone would keep the whole buffer alive


def _quantize(x: mx.array, group_size: int, bits: int) -> Triple:
    q = mx.quantize(x, group_size=group_size, bits=bits)
    return q[0], q[1], q[2]


def _empty_triple(shape: tuple[int, int, int], dim: int, dtype: mx.Dtype, group_size: int, bits: int) -> Triple:
    per_word = 32 // bits
    return (
        mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
    )
