"""Full-precision KV caches: plain (grows in 256-token steps); rotating ones are in cache/rotating.py.

Buffer arithmetic follows mlx-lm's `KVCache` / `RotatingKVCache` exactly, so greedy output is
token-for-token identical to mlx-lm's; on top they implement the `CompiledDecodeCache` contract.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv_inference.cache.contract import CacheTrimError, DecodePhase, DecodePlan
from mlxkv_inference.cache.masks import mlx_causal
from mlxkv_inference.cache.stand_ins import KvStandIn, PlainKvStandIn

STEP = 256


class DenseBuffers:
    """What both full-precision kinds derive from their key and value buffers."""

    keys: mx.array | None
    values: mx.array | None

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None or self.values is None else self.keys.nbytes + self.values.nbytes

    def bytes_per_token(self) -> int:
        return _bytes_per_token(self.keys, self.values)


class PlainKVCache(DenseBuffers):
    """Keys and values for every token; trimmable to any length."""

    step = STEP

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    # -- mlx-lm cache interface -------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev = self.offset
        self._reserve(keys, values, keys.shape[2])
        assert self.keys is not None and self.values is not None
        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self._fetch()

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> Any:
        return causal_mask(n, self.offset, window_size, return_array)

    def size(self) -> int:
        return self.offset

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None, int]:
        return self.keys, self.values, self.offset

    # -- contract ------------------------------------------------------------------------
    @property
    def minimum_reusable_offset(self) -> int:
        return 0

    def signature(self) -> str:
        return "kv.plain/1"

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int, bypass: bool = False) -> int:
        n = check_trim(n, self.offset)
        self.offset -= n
        return n

    def decode_phase(self) -> DecodePhase:
        return "concat"

    def prepare_decode_step(self, rows: int = 1) -> DecodePlan | None:
        if self.keys is None or self.values is None:
            return None
        self._reserve(self.keys, self.values, rows)
        assert self.keys is not None
        return DecodePlan("concat", self.keys.shape[2], self.offset, self.offset, rows)

    def decode_stand_in(self, plan: DecodePlan) -> KvStandIn:
        return PlainKvStandIn(plan)

    def decode_inputs(self, plan: DecodePlan) -> list[mx.array]:
        assert self.keys is not None and self.values is not None
        position = mx.array(plan.offset, dtype=mx.int32)
        return [self.keys, self.values, position, position]

    def commit_decode_step(self, plan: DecodePlan, outputs: list[mx.array]) -> None:
        self.keys, self.values = outputs
        self.offset = plan.offset + plan.rows

    def dispose(self) -> None:
        self.keys = self.values = None
        self.offset = 0

    def clone(self) -> PlainKVCache:
        """An independent cache sharing the buffers until either side writes (MLX copy-on-write)."""
        other = PlainKVCache()
        other.keys, other.values, other.offset = buffer_view(self.keys), buffer_view(self.values), self.offset
        return other

    def compact(self) -> None:
        """Hold the tokens in buffers of exactly `offset` positions, owned by this cache alone."""
        self.keys, self.values = owned_prefix(self.keys, self.offset), owned_prefix(self.values, self.offset)

    # -- helpers -----------------------------------------------------------------------------
    def _reserve(self, keys: mx.array, values: mx.array, n: int) -> None:
        """Grow the buffers (in whole steps) so `n` more tokens fit after `offset`."""
        self.reserve(n, keys.shape[1], keys.shape[3], values.shape[3], keys.dtype, batch=keys.shape[0])

    def reserve(self, n: int, heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype, batch: int = 1) -> None:
        """Grow the buffers (in whole steps, as mlx-lm does) so `n` more tokens fit after `offset`."""
        prev = self.offset
        if self.keys is not None and self.values is not None and prev + n <= self.keys.shape[2]:
            return
        n_steps = (self.step + n - 1) // self.step
        new_k = mx.zeros((batch, heads, n_steps * self.step, k_dim), dtype)
        new_v = mx.zeros((batch, heads, n_steps * self.step, v_dim), dtype)
        if self.keys is None or self.values is None:
            self.keys, self.values = new_k, new_v
            return
        if prev % self.step != 0:
            self.keys, self.values = self.keys[..., :prev, :], self.values[..., :prev, :]
        self.keys = mx.concatenate([self.keys, new_k], axis=2)
        self.values = mx.concatenate([self.values, new_v], axis=2)

    def _fetch(self) -> tuple[mx.array, mx.array]:
        assert self.keys is not None and self.values is not None
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values


def causal_mask(n: int, offset: int, window_size: int | None, return_array: bool) -> Any:
    """mlx-lm's mask choice for a cache at `offset` receiving `n` tokens."""
    if window_size is not None:
        return mlx_causal(n, offset, window_size)
    if n == 1:
        return None
    return mlx_causal(n, offset, None) if return_array else "causal"


def buffer_view(a: mx.array | None) -> mx.array | None:
    # A new array object over the same buffer: slice assignment on one never shows in the other.
    return None if a is None else a[...]


def owned_prefix(a: mx.array | None, n: int) -> mx.array | None:
    # NOTE: a slice is a view that keeps the whole buffer alive; contiguous() copies it out.
    return None if a is None else mx.contiguous(a[..., :n, :])


def check_trim(n: int, offset: int) -> int:
    if n < 0:
        raise ValueError(f"trim count must be >= 0, got {n}")
    return min(n, offset)


def _bytes_per_token(*buffers: mx.array | None) -> int:
    """Bytes one token occupies across (batch, heads, tokens, dim) buffers."""
    total = 0
    for b in buffers:
        if b is not None:
            total += b.shape[0] * b.shape[1] * b.shape[3] * b.itemsize
    return total
