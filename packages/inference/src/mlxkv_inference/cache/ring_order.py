"""Why a full sliding-window ring is attended oldest key first, and the cells in that order.

The fixed-order reductions (16 lanes by buffer position, `csrc/blas_shim.cpp`) make a row's
attention depend on where each key sits in the array it attends. A prompt chunk attends its keys
oldest first (the window's last keys, then its own). mlx-lm's single step over a full ring
attends the ring cell by cell, so a position's logits depended on whether it was fed in a chunk
or as a step, and on where the last chunk ended (a warm multi-turn cache against a cold prefill,
a resumed generation against the uninterrupted one). Here a step over a full ring attends its
keys oldest first too, and a speculative round over it is a chunk: every way of feeding a
position gives it the same bits.

    ring (window 4, keep 0) after writing position 10 into cell 2:   [ 8  9 10  7 ]
    attended as                                                      [ 7  8  9 10 ]
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["oldest_first"]


def oldest_first(oldest: mx.array | int, keep: int, size: int, drop_oldest: bool = False) -> mx.array:
    """The cells of a full ring of `size` cells (the first `keep` never overwritten) from the
    oldest key to the newest, where `oldest` is the oldest overwritable cell; `drop_oldest`
    leaves that cell out (a chunk keeps the window's last size - 1 keys, as `_update_concat` does)."""
    ring = size - keep
    steps = mx.arange(1 if drop_oldest else 0, ring, dtype=mx.int32)
    cells = keep + (steps + (mx.array(oldest, dtype=mx.int32).reshape(()) - keep)) % ring
    return mx.concatenate([mx.arange(keep, dtype=mx.int32), cells]) if keep else cells
