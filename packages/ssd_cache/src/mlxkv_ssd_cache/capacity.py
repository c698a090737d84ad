"""How much the store may hold and what goes to make room.

    cap   prompt entries, objects and generation checkpoints together, least recently used out
          first (the rules of `PrefixIndex`); the effective cap is
          min(max_bytes, bytes held + free space of the filesystem - reserve_bytes), and a write
          that still finds the disk full evicts older entries and tries again
    ttl   checkpoints expire `checkpoint_ttl_s` after their last write
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxkv_ssd_cache.index import Item, StoreIndex

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINT_TTL_S = 24 * 3600.0
DEFAULT_RESERVE_BYTES = 64 << 20  # left free on the filesystem for everything else

FreeSpaceProbe = Callable[[Path], int]


@dataclass(frozen=True, slots=True)
class DiskBudget:
    """The configured cap and how to measure the filesystem under `root`."""

    root: Path
    max_bytes: int
    reserve_bytes: int
    free_space: FreeSpaceProbe

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes={self.max_bytes} must be >= 1")
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes={self.reserve_bytes} must be >= 0")

    def free(self) -> int:
        """Free bytes on the filesystem; when unknown, enough that the configured cap holds."""
        try:
            return self.free_space(self.root)
        except OSError as e:
            log.warning("free space of %s unknown (%s); using the configured cap", self.root, e)
            return self.max_bytes + self.reserve_bytes

    def cap_of(self, free: int) -> Callable[[int], int]:
        """The effective cap as a function of the bytes held: what we hold plus what the disk takes."""
        return lambda held: max(0, min(self.max_bytes, held + free - self.reserve_bytes))


class Capacity:
    """Keeps the index under the effective cap: decides what goes (in the index, under its lock)
    and deletes the files dropped (outside it)."""

    def __init__(self, index: StoreIndex, budget: DiskBudget, checkpoint_ttl_s: float, clock: Callable[[], float]) -> None:
        if checkpoint_ttl_s <= 0:
            raise ValueError(f"checkpoint_ttl_s={checkpoint_ttl_s} must be > 0 seconds")
        self.index = index
        self.budget = budget
        self.checkpoint_ttl_s = checkpoint_ttl_s
        self.clock = clock

    def effective_max_bytes(self) -> int:
        """The cap in force now: `max_bytes`, or less when the filesystem cannot hold that much."""
        return self.budget.cap_of(self.budget.free())(self.index.nbytes())

    def make_room(self, needed: int, keep: str) -> bool:
        """Evict least recently used entries so that `needed` more bytes fit the effective cap;
        False (nothing evicted) when they would not fit even with every entry gone."""
        evicted = self.index.make_room(needed, self.budget.cap_of(self.budget.free()), keep)
        if evicted is None:
            return False
        self.drop(evicted)
        return True

    def evict_for_full_disk(self, needed: int, keep: str) -> bool:
        """The disk is full: evict about `needed` bytes' worth; False when nothing was left to evict."""
        evicted = self.index.evict_to(lambda held: held - max(needed, 1), keep=keep)
        if evicted:
            log.info("disk full: evicted %d entries to make room", len(evicted))
            self.drop(evicted)
        return bool(evicted)

    def admit(self, item: Item) -> None:
        """Index a written file; supersede, expire and evict what it makes redundant or pushes out."""
        cap_of = self.budget.cap_of(self.budget.free())
        self.drop(self.index.admit(item, cap_of, self.clock(), self.checkpoint_ttl_s))

    def expire(self, items: Sequence[Item]) -> None:
        self.drop(self.index.expire(items))

    def load(self, items: Sequence[Item]) -> None:
        """Index the files found at start-up, then enforce the cap."""
        self.drop(self.index.load(items, self.clock(), self.checkpoint_ttl_s))
        self.drop(self.index.evict_to(self.budget.cap_of(self.budget.free())))

    def drop(self, items: Sequence[Item]) -> None:
        """Delete files dropped from the index (outside its lock), unless one was re-added meanwhile."""
        for item in items:
            if not self.index.is_current(item):
                item.value.path.unlink(missing_ok=True)
