"""`PrefixIndex`: the model-free index of stored prompt states both prompt-cache tiers keep.

    longest:  the entry with the longest usable prefix of a prompt (rules in reuse.py);
              ties go to the most recently used entry
    add:      an entry replaces the one with its key and supersedes the shorter ancestors it can
              be trimmed down to (same namespace)
    evict:    least recently used first, until the entries fit a byte budget

NOTE: recency is a counter, not a clock: no two entries tie, so lookups and eviction order are
reproducible. An entry without tokens (a stored object) is never found by prefix and never
superseded; it only ages. Not thread-safe: each tier holds its own lock around its index.
Lookups and supersedes go through a radix tree per namespace (_prefix_trie.py), so their cost
follows the branch points on the prompt's path, not the number of entries.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from mlxkv_inference.cache._prefix_trie import PrefixTrie
from mlxkv_inference.cache.reuse import supersedes

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(slots=True)
class Indexed(Generic[K, V]):
    """One entry: what the reuse rules need, its accounted bytes, and the tier's own value."""

    key: K
    ns: str
    tokens: tuple[int, ...]
    nbytes: int
    minimum_reusable_offset: int
    trimmable: bool
    value: V
    recency: int = 0


class PrefixIndex(Generic[K, V]):
    def __init__(self) -> None:
        self._entries: dict[K, Indexed[K, V]] = {}
        self._tries: dict[str, PrefixTrie[K, V]] = {}
        self._clock = 0
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def get(self, key: K) -> Indexed[K, V] | None:
        return self._entries.get(key)

    def lru_order(self) -> list[Indexed[K, V]]:
        """Every entry, least recently used first."""
        return sorted(self._entries.values(), key=lambda e: e.recency)

    def longest(self, prompt: Sequence[int], ns: str) -> tuple[Indexed[K, V], int] | None:
        """The entry of `ns` with the longest usable prefix of `prompt` and that prefix's length."""
        trie = self._tries.get(ns)
        return None if trie is None else trie.longest(tuple(prompt))

    def touch(self, key: K) -> None:
        """Make `key` the most recently used entry (no-op when it is gone)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.recency = self._tick()
            if entry.tokens:
                self._tries[entry.ns].touch(entry)

    def add(self, entry: Indexed[K, V]) -> list[Indexed[K, V]]:
        """Insert `entry` as the most recently used; returns the ancestors it superseded (removed),
        shortest first.

        An entry already under `entry.key` is replaced and not returned (the caller overwrote it).
        """
        self.remove(entry.key)
        entry.recency = self._tick()
        self._entries[entry.key] = entry
        self._nbytes += entry.nbytes
        if not entry.tokens:
            return []
        trie = self._tries.setdefault(entry.ns, PrefixTrie())
        trie.add(entry)
        superseded = [
            old for old in trie.strict_prefixes(entry)
            if supersedes(entry.tokens, entry.trimmable, entry.minimum_reusable_offset, old.tokens)
        ]
        for old in superseded:
            self.remove(old.key)
        return superseded

    def remove(self, key: K) -> Indexed[K, V] | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._nbytes -= entry.nbytes
            if entry.tokens:
                self._forget(entry)
        return entry

    def evict_to(self, budget: int, keep: K | None = None) -> list[Indexed[K, V]]:
        """Remove least recently used entries (never `keep`) until the rest fit `budget` bytes."""
        evicted: list[Indexed[K, V]] = []
        for entry in self.lru_order():
            if self._nbytes <= budget:
                break
            if entry.key != keep:
                self.remove(entry.key)
                evicted.append(entry)
        return evicted

    def _forget(self, entry: Indexed[K, V]) -> None:
        trie = self._tries[entry.ns]
        trie.remove(entry)
        if not trie:
            del self._tries[entry.ns]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
