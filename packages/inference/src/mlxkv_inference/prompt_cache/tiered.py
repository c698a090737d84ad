"""The tiered prompt cache: a byte-capped RAM tier over a durable cold tier.

    fetch:   RAM take  vs  cold find (index only)  -> the cold tier wins only with a strictly
             longer usable prefix; what it restores is republished into RAM
    publish: RAM put, then a write-behind to the cold tier (no request waits on the disk)
    evict:   an entry leaves RAM only once a durable copy exists or its write is queued
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import clone_trimmed, frozen_copy
from mlxkv_inference.prompt_cache.cold_tier import ColdTier
from mlxkv_inference.prompt_cache.ram_tier import RamEntry, RamPromptCache
from mlxkv_inference.prompt_cache.write_behind import WriteBehind, WriteJob

Tier = Literal["ram", "ssd"]


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


class TieredPromptCache:
    def __init__(self, ram_max_bytes: int, cold: ColdTier | None = None) -> None:
        self._cold = cold
        self._ram = RamPromptCache(ram_max_bytes, on_evict=self._demote)
        self._writer = WriteBehind(cold, self._durable) if cold is not None else None
        self._lock = threading.Lock()
        self._hits = {"ram": 0, "ssd": 0}
        self._misses = 0
        self._saved = 0

    @property
    def ram(self) -> RamPromptCache:
        return self._ram

    def fetch(self, prompt: Sequence[int], ns: str) -> Fetched:
        ram_usable = self._ram.usable_tokens(prompt, ns)
        hit = self._cold.find(prompt, ns) if self._cold is not None else None
        if self._cold is not None and hit is not None and hit.num_tokens > ram_usable:
            restored = self._cold.restore(hit)
            if restored is not None:
                self._ram.put(restored.tokens, clone_trimmed(restored.caches, len(restored.tokens)), ns, durable=True)
                return self._count(Fetched(restored.caches, len(restored.tokens), "ssd"))
        taken = self._ram.take(prompt, ns) if ram_usable else None
        if taken is not None:
            return self._count(Fetched(taken.caches, taken.num_tokens, "ram"))
        return self._count(Fetched(None, 0, None))

    def publish(self, tokens: Sequence[int], caches: Sequence[LayerCache], ns: str) -> None:
        """Keep a prompt state in RAM and write it behind to the cold tier."""
        if not tokens:
            return
        # One frozen copy serves both tiers; the generation goes on writing into its own caches.
        copies = frozen_copy(caches, len(tokens))
        self._ram.put(tokens, copies, ns)
        if self._writer is not None:
            self._writer.submit(tokens, copies, ns)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every state published so far is durable (True when there is no cold tier)."""
        return self._writer.flush(timeout) if self._writer is not None else True

    def close(self, timeout: float | None = None) -> bool:
        return self._writer.close(timeout) if self._writer is not None else True

    def stats(self) -> TierStats:
        writer = self._writer
        with self._lock:
            return TierStats(
                ram_hits=self._hits["ram"], ssd_hits=self._hits["ssd"], misses=self._misses, tokens_saved=self._saved,
                ram_bytes=self._ram.nbytes, ram_entries=len(self._ram), ram_max_bytes=self._ram.max_bytes,
                ram_evictions=self._ram.evictions,
                pending_writes=writer.pending if writer else 0, pending_write_bytes=writer.pending_bytes if writer else 0,
                writes_done=writer.written if writer else 0, writes_failed=writer.failed if writer else 0,
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
        # holds it until the cold tier has it.
        if not entry.durable and self._writer is not None:
            self._writer.submit(entry.tokens, entry.caches, entry.ns)

    def _durable(self, job: WriteJob) -> None:
        self._ram.mark_durable(job.tokens, job.ns)
