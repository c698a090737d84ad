"""A sliding-window KV cache on mlx-lm's `RotatingKVCache` buffer arithmetic (cache/ring_buffer.py),
a full ring attended oldest key first (cache/ring_order.py), with the `CompiledDecodeCache`
contract, speculative rounds and pipelined steps over its ring."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv_inference.cache.contract import CacheTrimError, DecodePhase, DecodePlan
from mlxkv_inference.cache.kv import buffer_view, check_trim, owned_prefix
from mlxkv_inference.cache.masks import mlx_causal
from mlxkv_inference.cache.ring_buffer import RingBuffer
from mlxkv_inference.cache.stand_ins import KvStandIn, RingRoundStandIn


class RotatingKVCache(RingBuffer):
    """A sliding window of `max_size` tokens (the first `keep` are never evicted).

    Phase "concat" until the window fills, then "ring": each token overwrites the oldest and
    attends the ring oldest key first, as a prompt chunk attends its keys. Once wrapped, evicted
    tokens are gone, so the cache is no longer trimmable, except `trim(n, bypass=True)` right
    after a multi-token write, which shrinks the buffer tail. A speculative round is written as a
    prompt chunk (compiled: in position order while the ring has room, as a chunk's buffers over a
    full ring) and its rejected positions are trimmed. A round never starts before the ring is
    full and ends past it (`round_fits`).
    """

    def __init__(self, max_size: int, keep: int = 0) -> None:
        super().__init__(max_size, keep)
        # Single-step writes on a full ring that `take_back` can undo: (offset, index before, cell, old key, value).
        self._undo: list[tuple[int, int, int, mx.array, mx.array]] = []
        self._arm = False  # log the next single-step write (a pipelined step's: `RunAhead`)

    # -- mlx-lm cache interface -------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] == 1:
            self._after_multi_write = False
            return self._update_in_place(keys, values)
        self._after_multi_write = True
        return self._update_concat(keys, values)

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> Any:
        if n > 1:
            window = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + n > window or return_array:
                return mlx_causal(n, offset, window)
            return "causal"
        if window_size is None or not (self.offset >= window_size and self.max_size > window_size):
            return None
        size = self.offset + 1 if self.offset < self.max_size else self.max_size
        return mx.arange(size) >= (size - window_size)  # the keys come oldest first

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def window(self) -> tuple[mx.array, mx.array]:
        """The keys and values of the positions the next token attends besides its own (the
        kept cells, then the newest), oldest first, however the buffer lies now."""
        if self.keys is None or self.values is None:
            raise ValueError("an empty rotating cache has no window")
        n = min(self.offset, self.max_size)

        def last(v: mx.array) -> mx.array:
            ordered = self._temporal_order(v)
            newest = ordered[..., ordered.shape[2] - (n - self.keep) :, :]
            return mx.concatenate([ordered[..., : self.keep, :], newest], axis=2) if self.keep else newest

        return last(self.keys), last(self.values)

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None, int, int, int, int]:
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx

    @property
    def ring_index(self) -> int:
        return self._idx

    def restore_ring(self, keys: mx.array, values: mx.array, offset: int, ring_index: int) -> None:
        """Install persisted buffers (what the codec wrote: the buffer up to min(len, offset))."""
        if keys.shape != values.shape[:3] + (keys.shape[3],) or keys.shape[2] > max(offset, 1) + self.max_size:
            raise ValueError(f"ring buffers of shape {keys.shape} do not fit offset {offset} and window {self.max_size}")
        if not 0 <= ring_index <= keys.shape[2]:
            raise ValueError(f"ring index {ring_index} is outside the {keys.shape[2]}-token buffer")
        self.keys, self.values, self.offset, self._idx = keys, values, offset, ring_index

    # -- contract ------------------------------------------------------------------------
    @property
    def minimum_reusable_offset(self) -> int:
        return 0

    def signature(self) -> str:
        return "kv.rotating/1"

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def trim(self, n: int, bypass: bool = False) -> int:
        n = check_trim(n, self.offset)
        if n == 0:
            return 0
        if bypass and self._after_multi_write and self.keys is not None and self.values is not None:
            # The buffer is in temporal order right after a multi-token write: cut its tail.
            end = self.keys.shape[2] - n
            if end < 1:
                raise CacheTrimError(f"cannot trim {n} of the {self.keys.shape[2]} buffered tokens")
            self.keys, self.values = self.keys[..., :end, :], self.values[..., :end, :]
            self.offset -= n
            self._idx = end
            return n
        if bypass:
            raise CacheTrimError("bypass trim is only possible right after a multi-token write")
        if not self.is_trimmable():
            raise CacheTrimError(f"rotating cache wrapped at {self.max_size} tokens (offset {self.offset}); it cannot be trimmed")
        self.offset -= n
        self._idx -= n
        return n

    def decode_phase(self) -> DecodePhase:
        return "ring" if self.offset >= self.max_size else "concat"

    def prepare_decode_step(self, rows: int = 1) -> DecodePlan | None:
        if self.keys is None or self.values is None:
            return None
        if rows > 1 and self.decode_phase() == "ring":  # a round over the full ring, fed as a chunk
            if rows > self.max_size - self.keep:
                return None
            self._prepare_in_place(self.keys, self.values)  # the window in the ring, `_idx` its oldest cell
            assert self.keys is not None
            return DecodePlan("ring", self.keys.shape[2], self._idx, self.offset, rows)
        if rows > 1:  # a round (`round_fits`): before the ring fills, the buffer in position order
            if self._idx != self.offset or self.offset + rows >= self.max_size:
                return None
            self._make_room(rows)
            return DecodePlan("concat", self.keys.shape[2], self._idx, self.offset, rows)
        self._prepare_in_place(self.keys, self.values)
        assert self.keys is not None
        return DecodePlan(self.decode_phase(), self.keys.shape[2], self._idx, self.offset)

    def decode_stand_in(self, plan: DecodePlan) -> KvStandIn | RingRoundStandIn:
        return RingRoundStandIn(self.keep) if plan.phase == "ring" and plan.rows > 1 else KvStandIn(plan, self.keep)

    def decode_inputs(self, plan: DecodePlan) -> list[mx.array]:
        assert self.keys is not None and self.values is not None
        return [self.keys, self.values, mx.array(plan.offset, dtype=mx.int32), mx.array(plan.write_index, dtype=mx.int32)]

    def commit_decode_step(self, plan: DecodePlan, outputs: list[mx.array]) -> None:
        self.keys, self.values = outputs
        if plan.phase == "ring" and plan.rows > 1:  # a chunk's buffers, oldest first
            self.offset = plan.offset + plan.rows
            self._idx = self.keys.shape[2]
            self._after_multi_write = True
            return
        self.offset = plan.offset + plan.rows
        self._idx = plan.write_index + plan.rows
        self._after_multi_write = False

    def dispose(self) -> None:
        self.keys = self.values = None
        self.offset = self._idx = 0

    def clone(self) -> RotatingKVCache:
        other = RotatingKVCache(self.max_size, self.keep)
        other.keys, other.values = buffer_view(self.keys), buffer_view(self.values)
        other.offset, other._idx, other._after_multi_write = self.offset, self._idx, self._after_multi_write
        return other

    def compact(self) -> None:
        """Hold only the buffered tokens (past the offset an unwrapped buffer holds zeros), in
        buffers owned by this cache alone."""
        n = self.offset if self.keys is None else min(self.keys.shape[2], self.offset)
        self.keys, self.values = owned_prefix(self.keys, n), owned_prefix(self.values, n)

    # -- pipelined steps on a full ring ----------------------------------------------------
    def _overwriting(self, offset: int, index: int, n: int) -> None:
        """Log a single-step write about to go into the ring (`arm_undo`): the cell's old key and
        value, lazily, read before the write."""
        logged, self._arm = self._arm and n == 1, False
        if logged and self.keys is not None and self.values is not None:
            cell = self._idx
            self._undo.append((offset, index, cell, self.keys[..., cell : cell + 1, :], self.values[..., cell : cell + 1, :]))

    @property
    def steady_ring(self) -> bool:
        """Whether the ring is full and holds exactly the window (its single steps can be taken back)."""
        return self.keys is not None and self.offset >= self.max_size and self.keys.shape[2] == self.max_size

    def arm_undo(self) -> None:
        """Log the next single-step write, so that `take_back` can undo it (on a steady ring: a
        write right after a longer prompt chunk first reshapes the buffer)."""
        self._arm = self.steady_ring

    def keep_undo(self, newest: int) -> None:
        """Forget all but the `newest` logged writes (the older ones stay for good)."""
        del self._undo[: max(len(self._undo) - newest, 0)]

    def take_back(self, n: int) -> bool:
        """Undo the last `n` single-step writes, each cell written back with what it held; False
        (nothing done) where fewer were logged (the caller trims)."""
        if n < 1 or n > len(self._undo):
            return False
        for offset, index, cell, key, value in reversed(self._undo[-n:]):
            assert self.keys is not None and self.values is not None
            self.keys[..., cell : cell + 1, :] = key
            self.values[..., cell : cell + 1, :] = value
            self.offset, self._idx = offset, index
        self._undo.clear()
        return True

