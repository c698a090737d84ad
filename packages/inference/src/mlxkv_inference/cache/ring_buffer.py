"""mlx-lm's `RotatingKVCache` buffer arithmetic, bit for bit: where a sliding window's keys and
values go in its buffer (grown in steps until the window fills, then a ring whose first `keep`
cells are never overwritten). One difference: a step over a full ring fetches the keys oldest
first (cache/ring_order.py). `RotatingKVCache` (cache/rotating.py) builds the cache on it."""

from __future__ import annotations

import mlx.core as mx

from mlxkv_inference.cache.kv import STEP, DenseBuffers


class RingBuffer(DenseBuffers):
    """A sliding window of `max_size` tokens (the first `keep` never evicted) in one buffer."""

    step = STEP

    def __init__(self, max_size: int, keep: int = 0) -> None:
        if max_size < 1 or not 0 <= keep < max_size:
            raise ValueError(f"rotating cache needs max_size >= 1 and 0 <= keep < max_size; got {max_size}, {keep}")
        self.max_size = max_size
        self.keep = keep
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self._idx = 0
        self._after_multi_write = False

    def _overwriting(self, offset: int, index: int, n: int) -> None:
        """Called by a single-step write after the buffer is prepared and before its `n` tokens go
        in at `_idx` (the cache was at `offset`, writing next at `index`): nothing here."""

    def _trim_front(self, trim_size: int, v: mx.array, append: mx.array | None = None) -> mx.array:
        parts = [v[..., : self.keep, :], v[..., trim_size + self.keep :, :]] if trim_size > 0 else [v]
        if append is not None:
            parts.append(append)
        return mx.concatenate(parts, axis=2)

    def _temporal_order(self, v: mx.array) -> mx.array:
        if self._idx == v.shape[2]:
            return v
        if self._idx < self.offset:
            return mx.concatenate([v[..., : self.keep, :], v[..., self._idx :, :], v[..., self.keep : self._idx, :]], axis=2)
        return v[..., : self._idx, :]

    def _update_concat(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys, self.values = self._temporal_order(self.keys), self._temporal_order(self.values)
            self._idx = self.keys.shape[2]
            # Keep max_size - 1 old tokens so every new token sees a full window.
            trim_size = self._idx - self.max_size + 1
            self.keys = self._trim_front(trim_size, self.keys, keys)
            self.values = self._trim_front(trim_size, self.values, values)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _make_room(self, rows: int) -> None:
        """Grow the buffer (by `step`s, up to the window) until `rows` more positions fit at the offset."""
        assert self.keys is not None and self.values is not None
        missing = self.offset + rows - self.keys.shape[2]
        if missing > 0:
            grow = min(max(self.step, missing), self.max_size - self.keys.shape[2])
            b, heads, _, k_dim = self.keys.shape
            self.keys = mx.concatenate([self.keys, mx.zeros((b, heads, grow, k_dim), self.keys.dtype)], axis=2)
            self.values = mx.concatenate([self.values, mx.zeros((b, heads, grow, self.values.shape[3]), self.values.dtype)], axis=2)

    def _prepare_in_place(self, keys: mx.array, values: mx.array) -> None:
        prev = self.offset
        if self.keys is None or self.values is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            b, heads, _, k_dim = keys.shape
            new_size = min(self.step, self.max_size - prev)
            new_k = mx.zeros((b, heads, new_size, k_dim), keys.dtype)
            new_v = mx.zeros((b, heads, new_size, values.shape[3]), values.dtype)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            self._idx = prev
        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self._trim_front(trim_size, self.keys)
            self.values = self._trim_front(trim_size, self.values)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep

    def _update_in_place(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        before = (self.offset, self._idx)
        self._prepare_in_place(keys, values)
        assert self.keys is not None and self.values is not None
        n = keys.shape[2]
        self._overwriting(*before, n)
        self.keys[..., self._idx : self._idx + n, :] = keys
        self.values[..., self._idx : self._idx + n, :] = values
        self.offset += n
        self._idx += n
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        # A full ring is attended oldest key first, as a chunk attends (cache/ring_order.py).
        return self._temporal_order(self.keys), self._temporal_order(self.values)
