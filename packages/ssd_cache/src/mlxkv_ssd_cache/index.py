"""The store's in-memory index of its files: one lock, never held while a file is touched.

Every decision about which entry goes (superseded, expired, least recently used past a budget) is
made here under the lock and handed back as the items dropped; the caller deletes their files
outside it (`Capacity.drop`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxkv_inference.cache.prefix_index import Indexed, PrefixIndex
from mlxkv_ssd_cache.scan import StoredFile

Item = Indexed[str, StoredFile]


@dataclass(frozen=True, slots=True)
class StoreStats:
    entries: int  # prompt states and objects
    bytes: int  # everything held, checkpoints included
    max_bytes: int
    quarantined: int
    evictions: int
    checkpoints: int
    expired_checkpoints: int


class StoreIndex:
    """A `PrefixIndex` of stored files behind a lock, with the counts `StoreStats` reports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._index: PrefixIndex[str, StoredFile] = PrefixIndex()
        self._quarantined = 0
        self._evictions = 0
        self._expired = 0

    def longest(self, prompt: Sequence[int], ns: str) -> tuple[Item, int] | None:
        with self._lock:
            return self._index.longest(prompt, ns)

    def get(self, key: str) -> Item | None:
        with self._lock:
            return self._index.get(key)

    def add(self, item: Item) -> list[Item]:
        """Index `item`; the entries it supersedes (their files are to delete)."""
        with self._lock:
            return self._index.add(item)

    def remove(self, key: str) -> Item | None:
        with self._lock:
            return self._index.remove(key)

    def touch(self, key: str) -> None:
        with self._lock:
            self._index.touch(key)

    def is_current(self, item: Item) -> bool:
        """Whether `item`'s file is the one indexed under its key (it may have been re-added)."""
        with self._lock:
            current = self._index.get(item.key)
        return current is not None and current.value.path == item.value.path

    def evict_to(self, budget_of: Callable[[int], int], keep: str | None = None) -> list[Item]:
        """Evict least recently used entries down to `budget_of(bytes held now)` (never `keep`)."""
        with self._lock:
            evicted = self._index.evict_to(budget_of(self._index.nbytes), keep=keep)
            self._evictions += len(evicted)
        return evicted

    def make_room(self, needed: int, cap_of: Callable[[int], int], keep: str) -> list[Item] | None:
        """Evict so that `needed` more bytes fit `cap_of(bytes held)`; None (nothing evicted)
        when they would not fit even with every entry gone."""
        with self._lock:
            cap = cap_of(self._index.nbytes)
            if needed > cap:
                return None
            evicted = self._index.evict_to(cap - needed, keep=keep)
            self._evictions += len(evicted)
        return evicted

    def load(self, items: Sequence[Item], now: float, ttl_s: float) -> list[Item]:
        """Index files found at start-up (least recently used first) but expired checkpoints;
        the entries superseded or expired (their files are to delete)."""
        dropped: list[Item] = []
        with self._lock:
            for item in items:
                if is_expired(item, now, ttl_s):
                    self._expired += 1
                    dropped.append(item)
                else:
                    dropped += self._index.add(item)
        return dropped

    def admit(self, item: Item, cap_of: Callable[[int], int], now: float, ttl_s: float) -> list[Item]:
        """Index a written file; the entries it supersedes, the checkpoints expired by `now` and
        the least recently used entries over `cap_of(bytes held)`, all dropped from the index."""
        with self._lock:
            superseded = self._index.add(item)
            expired = [i for i in self._index.lru_order() if is_expired(i, now, ttl_s)]
            for old in expired:
                self._index.remove(old.key)
            self._expired += len(expired)
            evicted = self._index.evict_to(cap_of(self._index.nbytes), keep=item.key)
            self._evictions += len(evicted)
        return superseded + expired + evicted

    def expire(self, items: Sequence[Item]) -> list[Item]:
        """Drop expired checkpoints; those that were still indexed."""
        with self._lock:
            gone = [i for i in items if self._index.remove(i.key) is not None]
            self._expired += len(gone)
        return gone

    def count_quarantined(self) -> None:
        with self._lock:
            self._quarantined += 1

    def nbytes(self) -> int:
        with self._lock:
            return self._index.nbytes

    def stats(self, max_bytes: int) -> StoreStats:
        with self._lock:
            items = self._index.lru_order()
            checkpoints = sum(1 for i in items if i.value.kind == "checkpoint")
            return StoreStats(len(items) - checkpoints, self._index.nbytes, max_bytes, self._quarantined,
                              self._evictions, checkpoints, self._expired)


def is_expired(item: Item, now: float, ttl_s: float) -> bool:
    """A checkpoint not rewritten for `ttl_s` seconds is expired; other entries never expire."""
    return item.value.kind == "checkpoint" and now - item.value.written_at > ttl_s
