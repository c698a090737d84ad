"""The RAM tier: prompt states (tokens, caches, namespace) under a byte cap, least recently used
first out. `take` never consumes an entry: it hands out trimmed copies sharing the buffers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import all_trimmable, clone_trimmed, minimum_reusable_offset, supersedes, usable_prefix


@dataclass(frozen=True, slots=True)
class Taken:
    """Caches holding the first `num_tokens` of the prompt."""

    caches: list[LayerCache]
    num_tokens: int


@dataclass(slots=True)
class RamEntry:
    ns: str
    tokens: tuple[int, ...]
    caches: list[LayerCache]
    nbytes: int
    minimum_reusable_offset: int
    trimmable: bool
    last_used: float
    durable: bool = False


EvictHook = Callable[[RamEntry], None]


class RamPromptCache:
    def __init__(self, max_bytes: int, on_evict: EvictHook | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"RAM prompt cache max_bytes={max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self._entries: dict[tuple[str, tuple[int, ...]], RamEntry] = {}
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, prompt: Sequence[int], ns: str) -> Taken | None:
        """Copies of the entry with the longest usable prefix of `prompt`, trimmed to it."""
        with self._lock:
            best: tuple[int, RamEntry] | None = None
            for entry in self._entries.values():
                if entry.ns != ns:
                    continue
                usable = usable_prefix(entry.tokens, prompt, entry.minimum_reusable_offset, entry.trimmable)
                if usable and (best is None or usable > best[0]):
                    best = (usable, entry)
            if best is None:
                return None
            usable, entry = best
            entry.last_used = time.monotonic()
            return Taken(clone_trimmed(entry.caches, usable), usable)

    def usable_tokens(self, prompt: Sequence[int], ns: str) -> int:
        """What `take` would return, without copying anything."""
        with self._lock:
            return max(
                (usable_prefix(e.tokens, prompt, e.minimum_reusable_offset, e.trimmable) for e in self._entries.values() if e.ns == ns),
                default=0,
            )

    def put(self, tokens: Sequence[int], caches: list[LayerCache], ns: str, *, durable: bool = False) -> bool:
        """Keep `caches` (owned from now on: pass copies, see `clone_trimmed`) covering `tokens`.

        False when the entry alone exceeds the cap.
        """
        copies = caches
        nbytes = sum(c.nbytes for c in copies)
        if nbytes > self.max_bytes or not tokens:
            return False
        entry = RamEntry(ns, tuple(tokens), copies, nbytes, minimum_reusable_offset(copies), all_trimmable(copies),
                         time.monotonic(), durable)
        with self._lock:
            self._entries[(ns, entry.tokens)] = entry
            self._supersede(entry)
            evicted = self._evict_over_cap(keep=entry)
        for old in evicted:
            if self._on_evict is not None:
                self._on_evict(old)
        return True

    def mark_durable(self, tokens: Sequence[int], ns: str) -> None:
        with self._lock:
            entry = self._entries.get((ns, tuple(tokens)))
            if entry is not None:
                entry.durable = True

    def entries(self) -> list[RamEntry]:
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def _supersede(self, new: RamEntry) -> None:
        for key, entry in list(self._entries.items()):
            if entry.ns == new.ns and supersedes(new.tokens, new.trimmable, new.minimum_reusable_offset, entry.tokens):
                del self._entries[key]

    def _evict_over_cap(self, keep: RamEntry) -> list[RamEntry]:
        evicted = []
        total = sum(e.nbytes for e in self._entries.values())
        for key, entry in sorted(self._entries.items(), key=lambda kv: kv[1].last_used):
            if total <= self.max_bytes:
                break
            if entry is keep:
                continue
            del self._entries[key]
            total -= entry.nbytes
            evicted.append(entry)
            self.evictions += 1
        return evicted
