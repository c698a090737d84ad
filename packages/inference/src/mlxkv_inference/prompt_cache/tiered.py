"""The tiered prompt cache: a byte-capped RAM tier over a durable cold tier.

    fetch:   RAM take  vs  cold find (index only)  -> the cold tier wins only with a strictly
             longer usable prefix; what it restores is republished into RAM
    publish: RAM put, then a write-behind to the cold tier (no request waits on the disk)
    evict:   an entry leaves RAM only once a durable copy exists or its write is queued; a write
             of an evicted entry that fails is retried (MAX_WRITE_ATTEMPTS in all), then counted lost
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from mlxkv_inference.background_writer import BackgroundWriter, FlushReport
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import clone_trimmed, frozen_copy
from mlxkv_inference.prompt_cache.cold_tier import ColdHit, ColdRestored, ColdTier
from mlxkv_inference.prompt_cache.ram_tier import RamEntry, RamPromptCache

log = logging.getLogger(__name__)
Tier = Literal["ram", "ssd"]
MAX_WRITE_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Fetched:
    """Caches holding the first `num_tokens` of the prompt (None and 0 on a miss)."""

    caches: list[LayerCache] | None
    num_tokens: int
    tier: Tier | None


@dataclass(frozen=True, slots=True)
class TierStats:
    ram_hits: int
    ssd_hits: int
    misses: int
    tokens_saved: int
    ram_bytes: int
    ram_entries: int
    ram_max_bytes: int
    ram_evictions: int
    pending_writes: int
    pending_write_bytes: int
    writes_done: int
    writes_failed: int
    entries_lost: int  # left RAM, and every write of them failed


@dataclass(frozen=True, slots=True)
class _Write:
    tokens: tuple[int, ...]
    caches: list[LayerCache]
    ns: str
    attempt: int = 1

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.ns, self.tokens

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


class TieredPromptCache:
    def __init__(self, ram_max_bytes: int, cold: ColdTier | None = None) -> None:
        self._cold = cold
        self._ram = RamPromptCache(ram_max_bytes, on_evict=self._demote)
        self._writer = BackgroundWriter("mlxkv-write-behind") if cold is not None else None
        self._lock = threading.Lock()
        self._hits = {"ram": 0, "ssd": 0}
        self._misses = 0
        self._saved = 0
        self._evicted: set[tuple[str, tuple[int, ...]]] = set()  # left RAM before a durable copy existed
        self._lost = 0

    @property
    def ram(self) -> RamPromptCache:
        return self._ram

    def fetch(self, prompt: Sequence[int], ns: str, read: ColdRestored | None = None) -> Fetched:
        """Caches holding the longest cached prefix of `prompt`: restored from the cold tier when
        it holds more than RAM (`read`, when `read_cold` ran that restore already), else from RAM."""
        hit = None if read is not None else self.cold_hit(prompt, ns)
        restored = read if read is not None else self._cold.restore(hit) if self._cold is not None and hit is not None else None
        if restored is not None:
            self._ram.put(restored.tokens, clone_trimmed(restored.caches, len(restored.tokens)), ns, durable=True)
            return self._count(Fetched(restored.caches, len(restored.tokens), "ssd"))
        ram_usable = self._ram.usable_tokens(prompt, ns)
        taken = self._ram.take(prompt, ns) if ram_usable else None
        if taken is not None:
            return self._count(Fetched(taken.caches, taken.num_tokens, "ram"))
        return self._count(Fetched(None, 0, None))

    def cold_hit(self, prompt: Sequence[int], ns: str) -> ColdHit | None:
        """The cold tier's prefix of `prompt` when it is longer than what RAM can serve (an index
        lookup: nothing is read)."""
        hit = self._cold.find(prompt, ns) if self._cold is not None else None
        return hit if hit is not None and hit.num_tokens > self._ram.usable_tokens(prompt, ns) else None

    def held(self, prompt: Sequence[int], ns: str) -> tuple[int, ColdHit | None]:
        """The longest usable prefix of `prompt` held (index lookups only), and the cold tier's hit
        when it is the longer: (RAM's tokens, None) otherwise."""
        return self._ram.usable_tokens(prompt, ns), self.cold_hit(prompt, ns)

    def read_cold(self, hit: ColdHit) -> Future[ColdRestored | None]:
        """Read `hit` on the cold tier's reader thread; hand the result to `fetch` as `read`."""
        assert self._cold is not None, "a cold hit comes from the cold tier"
        return self._cold.restore_async(hit)

    def publish(self, tokens: Sequence[int], caches: Sequence[LayerCache], ns: str) -> None:
        """Keep a prompt state in RAM and write it behind to the cold tier."""
        if not tokens or (self._cold is None and self._ram.max_bytes == 0):  # nothing would keep it: no copy
            return
        # One frozen copy serves both tiers; the generation goes on writing into its own caches.
        copies = frozen_copy(caches, len(tokens))
        self._ram.put(tokens, copies, ns)
        self._submit(_Write(tuple(tokens), copies, ns), if_absent=True)

    def flush(self, timeout: float | None = None) -> FlushReport:
        """Wait until every state published so far is written; the report counts the writes
        done and failed since the previous flush (settled, none failed without a cold tier)."""
        return self._writer.flush(timeout) if self._writer is not None else FlushReport(True, 0, 0)

    def close(self, timeout: float | None = None) -> FlushReport:
        return self._writer.close(timeout) if self._writer is not None else FlushReport(True, 0, 0)

    def stats(self) -> TierStats:
        writer = self._writer.stats() if self._writer is not None else None
        with self._lock:
            return TierStats(
                ram_hits=self._hits["ram"], ssd_hits=self._hits["ssd"], misses=self._misses, tokens_saved=self._saved,
                ram_bytes=self._ram.nbytes, ram_entries=len(self._ram), ram_max_bytes=self._ram.max_bytes,
                ram_evictions=self._ram.evictions,
                pending_writes=writer.pending if writer else 0, pending_write_bytes=writer.pending_bytes if writer else 0,
                writes_done=writer.written if writer else 0, writes_failed=writer.failed if writer else 0,
                entries_lost=self._lost,
            )

    def _count(self, fetched: Fetched) -> Fetched:
        with self._lock:
            if fetched.tier is None:
                self._misses += 1
            else:
                self._hits[fetched.tier] += 1
                self._saved += fetched.num_tokens
        return fetched

    def _demote(self, entry: RamEntry) -> None:
        # Persist before demotion: a state not yet durable goes to the writer's queue, which
        # holds it until the cold tier has it (a write already queued or running will do).
        if entry.durable or self._writer is None:
            return
        write = _Write(entry.tokens, entry.caches, entry.ns)
        with self._lock:
            self._evicted.add(write.key)
        self._submit(write, if_absent=True)

    def _submit(self, write: _Write, *, if_absent: bool) -> None:
        if self._writer is not None:
            self._writer.submit(write.key, lambda: self._write(write), nbytes=write.nbytes, if_absent=if_absent)

    def _write(self, write: _Write) -> bool:
        assert self._cold is not None
        try:
            stored = self._cold.store(write.tokens, write.caches, write.ns)
        except Exception:  # noqa: BLE001 - a store fault is a failed write, retried like any other
            log.warning("prompt cache write of %d tokens raised", len(write.tokens), exc_info=True)
            stored = False
        if stored:
            self._ram.mark_durable(write.tokens, write.ns)
            with self._lock:
                self._evicted.discard(write.key)
            return True
        self._after_failure(write)
        return False

    def _after_failure(self, write: _Write) -> None:
        # An entry still in RAM is written again when it is evicted; one that left RAM is retried
        # from the end of the queue (other writes go first), and counted lost after the last try.
        with self._lock:
            if write.key not in self._evicted:
                return
            retry = write.attempt < MAX_WRITE_ATTEMPTS
            if not retry:
                self._evicted.discard(write.key)
                self._lost += 1
        if retry:
            self._submit(replace(write, attempt=write.attempt + 1), if_absent=False)
        else:
            log.warning("a prompt state of %d tokens is lost: it left RAM and %d writes of it failed",
                        len(write.tokens), MAX_WRITE_ATTEMPTS)
