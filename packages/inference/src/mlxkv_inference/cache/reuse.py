"""When a stored prefix may serve a new prompt: the rules every prompt-cache tier shares.

    entry   t0 t1 ... t(m-1)
    prompt  t0 t1 ... t(c-1) x ...          c = common prefix
    usable  = min(c, len(prompt) - 1)       (the last prompt token is always fed, to get logits)

An entry is skipped when `usable` is below its minimum reusable offset, or shorter than the entry
while the entry cannot be trimmed (a wrapped ring, recurrent state).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlxkv_inference.cache.factory import LayerCache


def usable_prefix(entry_tokens: Sequence[int], prompt: Sequence[int], minimum_reusable_offset: int, trimmable: bool) -> int:
    """Tokens of the entry a prompt can reuse; 0 when it cannot use the entry at all."""
    usable = min(common_prefix(entry_tokens, prompt), len(prompt) - 1)
    if usable < 1 or usable < minimum_reusable_offset:
        return 0
    if usable < len(entry_tokens) and not trimmable:
        return 0
    return usable


def supersedes(new_tokens: Sequence[int], new_trimmable: bool, new_minimum_reusable: int, old_tokens: Sequence[int]) -> bool:
    """Whether a new entry makes an older one redundant: the old is a strict prefix of the new
    and the new can be trimmed down to it (an exact duplicate is replaced by the caller)."""
    return (
        new_trimmable
        and len(old_tokens) < len(new_tokens)
        and len(old_tokens) >= new_minimum_reusable
        and tuple(new_tokens[: len(old_tokens)]) == tuple(old_tokens)
    )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def minimum_reusable_offset(caches: Sequence[LayerCache]) -> int:
    return max((c.minimum_reusable_offset for c in caches), default=0)


def all_trimmable(caches: Sequence[LayerCache]) -> bool:
    return all(c.is_trimmable() for c in caches)


def clone_trimmed(caches: Sequence[LayerCache], num_tokens: int) -> list[LayerCache]:
    """Independent copies of `caches` holding their first `num_tokens` tokens."""
    out: list[LayerCache] = []
    for cache in caches:
        copy = cache.clone()
        excess = copy.offset - num_tokens
        if excess > 0:
            copy.trim(excess)
        out.append(copy)
    return out


def frozen_copy(caches: Sequence[LayerCache], num_tokens: int) -> list[LayerCache]:
    """`clone_trimmed`, evaluated here: a snapshot other threads (writers) may read while this
    thread goes on writing into the originals (MLX streams are per thread)."""
    copies = clone_trimmed(caches, num_tokens)
    mx.eval([c.state for c in copies])
    return copies


def compact_copy(caches: Sequence[LayerCache], num_tokens: int) -> list[LayerCache]:
    """`frozen_copy` in buffers of exactly the tokens held, copied out of any larger buffer:
    what a tier keeps, so it accounts and holds only what the tokens need."""
    copies = clone_trimmed(caches, num_tokens)
    for cache in copies:
        cache.compact()
    mx.eval([c.state for c in copies])
    return copies


def covered_tokens(caches: Sequence[LayerCache]) -> int:
    """How many tokens the caches hold (they move together; recurrent ones count theirs)."""
    return min((c.offset for c in caches), default=0)
