"""A round over a sequence's caches: one forward feeds several positions, and the caches keep
exactly the first n of them afterwards (trimmed, or rolled back and fed again).

Used by speculative rounds (`speculative/`) and by the binding's probes that check a
multi-position forward is bitwise single steps; it lives with the caches so both can use it.

Rolling back: KV caches drop the rejected positions by trimming (a full sliding-window ring took
the round as a prompt chunk, whose buffer tail is cut); recurrent caches go back to
their pre-round state and the kept positions are fed again: through each recurrent layer alone,
from the inputs it recorded on the round's forward (`cache/recurrent_replay.py`, where the binding
probed it exact), else through the whole model in one forward (exact for the same reason).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_inference.cache.quantized import QuantizedKVCache
from mlxkv_inference.cache.recurrent import RecurrentCache
from mlxkv_inference.kv_scheme import KvScheme

# Feeds tokens into caches through the model, evaluated (a rolled-back round's kept positions).
Refeed = Callable[[list[int], list[LayerCache]], int]


def round_fits(caches: Sequence[LayerCache], positions: int, kv_scheme: KvScheme, full_rings: bool = False) -> int:
    """The most positions (<= `positions`) one forward may verify from the caches' state, give
    each position's logits bitwise as single steps would, and roll back: a sliding window that
    has room must not fill (a round is written as a prompt chunk and trimmed), one that is full
    takes a round of at most its ring (a chunk, `cache/ring_order.py`) where `full_rings` (the
    binding probed that exact), else none; and a plain cache must stay below
    the KV scheme's quantization start (single steps would attend the positions past it quantized)."""
    fits = positions
    for cache in caches:
        if isinstance(cache, RotatingKVCache):
            full = cache.offset >= cache.max_size
            fits = min(fits, (cache.max_size - cache.keep if full_rings else 1) if full else cache.max_size - cache.offset - 1)
        elif kv_scheme.bits is not None and not isinstance(cache, (QuantizedKVCache, RecurrentCache)):
            fits = min(fits, kv_scheme.quantized_start - cache.offset - 1)
    return max(fits, 1)


def can_take_back(caches: Sequence[LayerCache], kv_scheme: KvScheme) -> bool:
    """Whether the caches can drop the next single token fed to them again (a pipelined step's,
    where the generation ends on the token before it): trimmed, or on a full sliding-window ring
    written back (`RotatingKVCache.take_back`)."""
    others = [c for c in caches if not (isinstance(c, RotatingKVCache) and c.steady_ring)]
    return round_fits(others, 2, kv_scheme) >= 2


class Round:
    """One open round over a sequence's caches: `begin` before its forward, `keep(n)` after.
    `replay`: recurrent layers may record how to feed kept positions again by themselves."""

    def __init__(self, caches: list[LayerCache], fed: int, replay: bool = False) -> None:
        self._caches = caches
        self._fed = fed
        self._offsets = [c.offset for c in caches]
        for cache in caches:
            if isinstance(cache, RecurrentCache):
                cache.spec_round_begin(replay)

    def keep(self, n: int, tokens: Sequence[int], refeed: Refeed) -> None:
        """Keep the round's first `n` fed positions (`tokens` are the round's fed tokens)."""
        if not 1 <= n <= self._fed:
            raise ValueError(f"a round keeps 1..{self._fed} positions, not {n}")
        recurrent = [c for c in self._caches if isinstance(c, RecurrentCache)]
        if n == self._fed or all(state.replayable for state in recurrent):  # none, or each recorded its replay
            for cache in self._caches:
                if isinstance(cache, RecurrentCache):
                    if n == self._fed:
                        cache.spec_round_commit()
                    else:
                        cache.spec_round_replay(n)
                elif n < self._fed:
                    _trim(cache, self._fed - n)
            if n < self._fed:
                mx.eval([state.state for state in recurrent])
            return
        for layer, start in zip(self._caches, self._offsets):  # back to the round's start, then the kept positions again
            if isinstance(layer, RecurrentCache):
                layer.spec_round_rollback()
            else:
                _trim(layer, layer.offset - start)
        refeed(list(tokens[:n]), self._caches)


def _trim(cache: LayerCache, n: int) -> None:
    """Drop a round's last `n` positions: a full ring cuts them off the chunk the round wrote."""
    cache.trim(n, bypass=isinstance(cache, RotatingKVCache) and not cache.is_trimmable())
