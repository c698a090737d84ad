"""Decode stand-ins: what mlx-lm's layers see as their cache inside the compiled decode step.

Shapes are fixed for a plan (a buffer of `capacity` positions, `rows` new ones); the RoPE offset
and the write index enter as arrays, so one trace serves every step until a buffer grows or a
ring wraps.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv_inference.cache.contract import CompiledStepUnsupported, DecodePlan
from mlxkv_inference.cache.masks import mlx_causal
from mlxkv_inference.cache.ring_order import oldest_first


class KvStandIn:
    """Plain or rotating KV: write the new token at `write_index`, attend over the buffer (a full
    ring oldest key first: `cache/ring_order.py`)."""

    def __init__(self, plan: DecodePlan, keep: int = 0) -> None:
        # Only the phase is baked into a trace; capacities come from the bound buffers' shapes.
        self._phase = plan.phase
        self._keep = keep
        self.keys = mx.array(0)
        self.values = mx.array(0)
        self.offset = mx.array(0)
        self._write = mx.array(0)

    num_outputs = 2

    def bind(self, inputs: list[mx.array]) -> None:
        self.keys, self.values, self.offset, self._write = inputs

    def outputs(self) -> list[mx.array]:
        return [self.keys, self.values]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        at = self._write.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, at, axes=(2,))
        self.values = mx.slice_update(self.values, values, at, axes=(2,))
        if self._phase != "ring":
            return self.keys, self.values
        size = self._capacity()
        oldest = mx.where(self._write + 1 >= size, self._keep, self._write + 1)
        cells = oldest_first(oldest, self._keep, size)
        return mx.take(self.keys, cells, axis=2), mx.take(self.values, cells, axis=2)

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> Any:
        if self._phase == "ring":
            if window_size is not None and window_size < self._capacity():
                raise CompiledStepUnsupported("a ring window narrower than its buffer runs uncompiled")
            return None
        if n > 1:  # a plain cache's round: position i sees the keys up to write + i
            return mx.arange(self._capacity())[None] <= (self._write + mx.arange(n))[:, None]
        return mx.arange(self._capacity()) <= self._write

    def _capacity(self) -> int:
        return self.keys.shape[2]


class RingRoundStandIn:
    """A round over a full ring, fed as a prompt chunk is (`RotatingKVCache._update_concat`, bit
    for bit): the window's last size - 1 keys oldest first, then the round's; the outputs are
    those buffers, which the cache keeps (trimmed after, like a chunk's)."""

    num_outputs = 2

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self.keys = mx.array(0)
        self.values = mx.array(0)
        self.offset = mx.array(0)
        self._oldest = mx.array(0)
        self._size = 0

    def bind(self, inputs: list[mx.array]) -> None:
        self.keys, self.values, self.offset, self._oldest = inputs
        self._size = self.keys.shape[2]

    def outputs(self) -> list[mx.array]:
        return [self.keys, self.values]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        cells = oldest_first(self._oldest, self._keep, self._size, drop_oldest=True)
        self.keys = mx.concatenate([mx.take(self.keys, cells, axis=2), keys], axis=2)
        self.values = mx.concatenate([mx.take(self.values, cells, axis=2), values], axis=2)
        return self.keys, self.values

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> Any:
        return mlx_causal(n, self._size - 1, window_size or self._size)


class PlainKvStandIn(KvStandIn):
    """A plain cache's stand-in: never a ring, so its keys are positions 0..write (what the native
    attention kernel needs to know to run inside the compiled step)."""

    @property
    def write_index(self) -> mx.array:
        return self._write


class QuantizedKvStandIn(KvStandIn):
    """Affine-quantized KV: (packed, scales, biases) triples for keys and for values."""

    def __init__(self, plan: DecodePlan, group_size: int, bits: int) -> None:
        super().__init__(plan)
        self.group_size = group_size
        self.bits = bits
        self._keys: list[mx.array] = []
        self._values: list[mx.array] = []

    num_outputs = 6

    def bind(self, inputs: list[mx.array]) -> None:
        self._keys, self._values = list(inputs[0:3]), list(inputs[3:6])
        self.offset, self._write = inputs[6], inputs[7]

    def outputs(self) -> list[mx.array]:
        return [*self._keys, *self._values]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        at = self._write.reshape(1)
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        self._keys = [mx.slice_update(b, u, at, axes=(2,)) for b, u in zip(self._keys, qk)]
        self._values = [mx.slice_update(b, u, at, axes=(2,)) for b, u in zip(self._values, qv)]
        return tuple(self._keys), tuple(self._values)

    def _capacity(self) -> int:
        return self._keys[0].shape[2]


class RecurrentStandIn:
    """Recurrent (conv + SSM) state: fixed-size arrays the layer reads and replaces."""

    def __init__(self, size: int) -> None:
        self.cache: list[mx.array | None] = [None] * size
        self.lengths = None
        self.left_padding = None
        self.offset = mx.array(0)
        self.num_outputs = size

    def __getitem__(self, index: int) -> mx.array | None:
        return self.cache[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.cache[index] = value

    def bind(self, inputs: list[mx.array]) -> None:
        *states, self.offset = inputs
        self.cache = list(states)

    def outputs(self) -> list[mx.array]:
        out = [c for c in self.cache if c is not None]
        assert len(out) == len(self.cache), "a recurrent layer cleared its state"
        return out

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, n: int) -> None:
        return None
