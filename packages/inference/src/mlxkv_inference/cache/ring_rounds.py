"""Where a speculative round's keys go in a sliding-window (rotating) cache, so each of its
positions attends exactly what a single decode step there would.

A single step at position p writes its key into the ring and attends the whole buffer: the last
`window` positions, in the ring's order. A round feeds p0..p(k-1) in one forward, but once the ring
has wrapped, p_i's cell still holds p_i - window, which every earlier position of the round must
see. So the round attends a buffer with room for both: each new key just before the cell it will
overwrite, and a mask per position that keeps exactly the keys its single step would see.

    ring (window 4) before a round of 10, 11, 12:   [ 8  9  6  7 ]    next cell: 2
    single steps there attend                      [ 8  9 10  7 ], [ 8  9 10 11 ], [12  9 10 11 ]
    the round attends                              [ 8 12  9 10  7 11 ]
      position 10 sees                             [ 8  .  9 10  7  . ]
      position 11 sees                             [ 8  .  9 10  . 11 ]
      position 12 sees                             [ . 12  9 10  . 11 ]

The keys each position sees are in the order its single step sees them; masked keys add exact
zeros wherever they sit (what the multi-position probe checks), so the logits are bitwise those
of the single steps. The cache keeps none of this layout: `RotatingKVCache.end_round` writes the
kept keys as single steps do.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

__all__ = ["RingState", "RoundLayout", "round_layout"]

EMPTY = -1  # a buffer cell no token was written to (spare capacity before the ring fills)


@dataclass(frozen=True, slots=True)
class RingState:
    """What decides a rotating cache's buffer layout (not its values)."""

    length: int  # buffer positions
    offset: int  # tokens seen
    index: int  # the next write (mlx-lm's `_idx`)
    keep: int
    max_size: int
    step: int  # growth of the buffer before the ring fills


@dataclass(frozen=True, slots=True)
class RoundLayout:
    """`gather`: for each position of the round's buffer, an index into the cache's buffer
    followed by the round's new keys; `visible[j]`: which of them position j attends."""

    gather: tuple[int, ...]
    visible: tuple[tuple[bool, ...], ...]


@lru_cache(maxsize=64)
def round_layout(state: RingState, rows: int) -> RoundLayout:
    """The round buffer for feeding `rows` positions into a cache in `state` (every rotating cache
    of a model shares one state, so the layout is worked out once per round)."""
    cells = _positions(state)
    source = {p: i for i, p in enumerate(cells) if p != EMPTY}
    views = _single_step_views(state, cells, rows)
    union = list(views[0])
    for j in range(1, rows):
        new, view = state.offset + j, views[j]
        at = view.index(new)
        if at + 1 < len(view):
            union.insert(union.index(view[at + 1]), new)  # just before the key it follows in the ring
        else:
            union.append(new)
    gather = tuple(source[p] if p < state.offset else state.length + p - state.offset for p in union)
    seen = [set(view) for view in views]
    return RoundLayout(gather, tuple(tuple(p in s for p in union) for s in seen))


def _positions(state: RingState) -> list[int]:
    """The token position each buffer cell holds (`RotatingKVCache._temporal_order`'s order,
    read backwards from the newest token)."""
    cells = [EMPTY] * state.length
    n, idx, keep = state.length, state.index, state.keep
    if idx == n:
        order = list(range(n))
    elif idx < state.offset:
        order = list(range(keep)) + list(range(idx, n)) + list(range(keep, idx))
    else:
        order = list(range(idx))
    for rank, cell in enumerate(order):
        cells[cell] = rank if rank < keep else state.offset - (len(order) - rank)
    return cells


def _single_step_views(state: RingState, cells: list[int], rows: int) -> list[list[int]]:
    """The keys (positions, in buffer order) single steps at offset, offset + 1, ... attend:
    `RotatingKVCache._update_in_place` on positions instead of values."""
    cells, offset, idx = list(cells), state.offset, state.index
    views = []
    for _ in range(rows):
        if offset >= len(cells) and len(cells) < state.max_size:
            cells += [EMPTY] * min(state.step, state.max_size - offset)
            idx = offset
        trim = len(cells) - state.max_size
        if trim > 0:
            cells = cells[: state.keep] + cells[trim + state.keep :]
            idx = state.max_size
        if idx == state.max_size:
            idx = state.keep
        cells[idx] = offset
        offset, idx = offset + 1, idx + 1
        views.append(cells[:offset] if offset < len(cells) else list(cells))
    return views
