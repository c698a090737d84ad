"""Speculative rounds over a full sliding-window ring, bitwise single steps.

A single step at position p writes its key into the ring cell of p - window and attends the whole
ring, cell by cell. A round feeds p0..p(k-1) in one forward, but each p_i needs a ring in which
only the cells of p0..p_i were overwritten: the cells of later positions still hold the keys
they evict. Laying both versions of a cell out side by side would move keys to other buffer
positions than a single step reads them at, and the fixed-order reductions (16 lanes by buffer
position, `csrc/blas_shim.cpp`) would then round differently. So each position gets its own copy
of the ring, as its single step would see it, and attention runs as a batch of one-query rows
(`row_attention`): every row is computed exactly as its single step is. Keys need no copy: each row's
scores are picked from scores against the ring and the new keys together.

    ring (window 4) before a round of 10, 11, 12:   [ 8  9  6  7 ]    next cell: 2
    the round's rows attend                         [ 8  9 10  7 ], [ 8  9 10 11 ], [12  9 10 11 ]

The cache keeps none of this: `RotatingKVCache.end_round` writes the kept keys as single steps do.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import mlx.core as mx

__all__ = ["round_cells", "round_inputs", "row_gather", "row_attention"]


def round_cells(index: int, keep: int, max_size: int, rows: int) -> list[int]:
    """The ring cells single steps from write index `index` write `rows` positions into."""
    cells, cell = [], index
    for _ in range(rows):
        if cell >= max_size:
            cell = keep
        cells.append(cell)
        cell += 1
    return cells


@lru_cache(maxsize=256)
def _gather(cells: tuple[int, ...], length: int) -> mx.array:
    rows: list[list[int]] = []
    for j in range(len(cells)):
        row = list(range(length))
        for i in range(j + 1):
            row[cells[i]] = length + i  # the round's i-th new key, after the ring's cells
        rows.append(row)
    return mx.array(rows, dtype=mx.int32)


def row_gather(index: int, keep: int, max_size: int, rows: int, length: int) -> mx.array:
    """(rows, length) indices into [the `length` ring cells, the round's new keys]: each row's
    ring, for a round of `rows` written from `index` (`round_cells`)."""
    return _gather(tuple(round_cells(index, keep, max_size, rows)), length)


def round_inputs(ring_keys: mx.array, ring_values: mx.array, keys: mx.array, values: mx.array,
                 gather: mx.array) -> tuple[mx.array, mx.array]:
    """What `row_attention` attends for a round's new `keys` and `values` over a ring of one
    sequence: the ring's keys followed by the new ones, and each row's ring of values
    ((rows, kv heads, window, dim)) picked by `gather` (`row_gather`)."""
    _, heads, length, dim = ring_values.shape
    rows = gather.shape[0]
    taken = mx.take(mx.concatenate([ring_values, values], axis=2), gather.reshape(-1), axis=2)
    return mx.concatenate([ring_keys, keys], axis=2), taken.reshape(heads, rows, length, dim).transpose(1, 0, 2, 3)


Attention = Callable[..., mx.array]


def row_attention(original: Attention) -> Attention:
    """mlx-lm's `scaled_dot_product_attention`, where a full ring's round (the cache's
    `rows_round`) attends one ring per row; any other call goes to `original` unchanged."""

    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                  mask: Any, sinks: Any = None) -> mx.array:
        if getattr(cache, "rows_round", False):
            if sinks is not None:  # the binding's probe then finds full-ring rounds off
                raise ValueError("a round over a full ring does not take attention sinks")
            return _rows(queries, keys, values, cache.round_gather, scale)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(attention, "row_rounds", True)  # marks a module already patched
    return attention


def _rows(queries: mx.array, keys: mx.array, values: mx.array, gather: mx.array, scale: float) -> mx.array:
    """MLX's attention (its CPU path, op for op) for each row j of `queries` (1, heads, rows, dim)
    over its own ring: `keys` (1, kv heads, window + rows, dim) are the ring's and then the round's
    new ones, and `gather` (rows, window) picks each row's from them; `values` (rows, kv heads,
    window, dim) are each row's ring already. A score is one dot product, so scoring every row
    against all keys and picking gives each row its single step's scores."""
    _, heads, rows, dim = queries.shape
    kv_heads = keys.shape[1]
    q = (queries * scale).reshape(1, kv_heads, heads // kv_heads, rows, dim)
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)  # (1, kv, rep, rows, window + rows)
    scores = mx.take_along_axis(scores, gather.reshape(1, 1, 1, rows, -1), axis=-1)
    weights = mx.softmax(scores, axis=-1, precise=True).transpose(3, 1, 2, 0, 4)  # (rows, kv, rep, 1, window)
    out = weights @ mx.expand_dims(values, 2)  # (rows, kv, rep, 1, dim)
    return out.transpose(3, 1, 2, 0, 4).reshape(1, heads, rows, dim)
