"""Rolling a speculative round back to its accepted prefix, exactly.

KV caches drop the round's tokens by trimming; recurrent caches restore their pre-round state.
The accepted tokens are then replayed one at a time, the way ordinary decode feeds them, so the
caches end bit-identical to a run that never speculated.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlxkv_inference.binding import MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.recurrent import RecurrentCache


def begin_round(caches: Sequence[LayerCache]) -> None:
    for cache in caches:
        if isinstance(cache, RecurrentCache):
            cache.spec_round_begin()


def commit_round(caches: Sequence[LayerCache]) -> None:
    for cache in caches:
        if isinstance(cache, RecurrentCache):
            cache.spec_round_commit()


def rollback_round(binding: MlxAutoregressiveBinding, caches: list[LayerCache], round_tokens: Sequence[int], keep: int) -> None:
    """Undo a round that fed `round_tokens`, keeping (and replaying) the first `keep` of them."""
    if not 0 <= keep <= len(round_tokens):
        raise ValueError(f"keep={keep} must be within the round's {len(round_tokens)} tokens")
    for cache in caches:
        if isinstance(cache, RecurrentCache):
            cache.spec_round_rollback(keep)
        else:
            cache.trim(len(round_tokens), bypass=not cache.is_trimmable())
    for token in round_tokens[:keep]:
        binding.decode(mx.array([token]), caches)
    mx.eval([c.state for c in caches])
