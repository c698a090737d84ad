"""The RAM tier: prompt states (tokens, caches, namespace) under a byte cap, least recently used
first out (the rules of `PrefixIndex`). Each entry holds its tokens in buffers of exactly their
size (no growth slack), so its accounted bytes are what it keeps. `take` never consumes an
entry: it hands out trimmed copies sharing the buffers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.prefix_index import Indexed, PrefixIndex
from mlxkv_inference.cache.reuse import all_trimmable, clone_trimmed, compact_copy, minimum_reusable_offset


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
    durable: bool = False


EvictHook = Callable[[RamEntry], None]
_Key = tuple[str, tuple[int, ...]]


class RamPromptCache:
    def __init__(self, max_bytes: int, on_evict: EvictHook | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"RAM prompt cache max_bytes={max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self._index: PrefixIndex[_Key, RamEntry] = PrefixIndex()
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._index.nbytes

    def __len__(self) -> int:
        return len(self._index)

    def take(self, prompt: Sequence[int], ns: str) -> Taken | None:
        """Copies of the entry with the longest usable prefix of `prompt`, trimmed to it."""
        with self._lock:
            found = self._index.longest(prompt, ns)
            if found is None:
                return None
            entry, usable = found
            self._index.touch(entry.key)
            return Taken(clone_trimmed(entry.value.caches, usable), usable)

    def usable_tokens(self, prompt: Sequence[int], ns: str) -> int:
        """What `take` would return, without copying anything."""
        with self._lock:
            found = self._index.longest(prompt, ns)
        return 0 if found is None else found[1]

    def put(self, tokens: Sequence[int], caches: Sequence[LayerCache], ns: str, *, durable: bool = False) -> bool:
        """Keep a compact copy of `caches` covering `tokens` (the caller keeps its own).

        False when the entry alone exceeds the cap.
        """
        if not tokens:
            return False
        kept = compact_copy(caches, len(tokens))
        nbytes = sum(c.nbytes for c in kept)
        if nbytes > self.max_bytes:
            return False
        entry = RamEntry(ns, tuple(tokens), kept, nbytes, durable)
        with self._lock:
            self._index.add(Indexed((ns, entry.tokens), ns, entry.tokens, nbytes, minimum_reusable_offset(kept),
                                    all_trimmable(kept), entry))
            evicted = [e.value for e in self._index.evict_to(self.max_bytes, keep=(ns, entry.tokens))]
            self.evictions += len(evicted)
        for old in evicted:
            if self._on_evict is not None:
                self._on_evict(old)
        return True

    def release(self, nbytes: int) -> int:
        """Evict least recently used entries until about `nbytes` have left (memory pressure; each
        is handed to `on_evict` as on a put, so a state not yet durable is written first). Returns
        the bytes evicted."""
        with self._lock:
            held = self._index.nbytes
            evicted = [e.value for e in self._index.evict_to(max(0, held - nbytes))]
            self.evictions += len(evicted)
        for old in evicted:
            if self._on_evict is not None:
                self._on_evict(old)
        return sum(e.nbytes for e in evicted)

    def mark_durable(self, tokens: Sequence[int], ns: str) -> None:
        with self._lock:
            entry = self._index.get((ns, tuple(tokens)))
            if entry is not None:
                entry.value.durable = True

    def entries(self) -> list[RamEntry]:
        """Every entry, least recently used first."""
        with self._lock:
            return [e.value for e in self._index.lru_order()]

    def clear(self) -> None:
        with self._lock:
            self._index = PrefixIndex()
