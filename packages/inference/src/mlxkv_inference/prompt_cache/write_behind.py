"""The background writer: persists prompt states to the cold tier so no request waits on disk."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.prompt_cache.cold_tier import ColdTier

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WriteJob:
    tokens: tuple[int, ...]
    caches: list[LayerCache]
    ns: str
    nbytes: int


class WriteBehind:
    """One daemon thread draining a queue of writes; the queue holds the caches until durable."""

    def __init__(self, cold: ColdTier, on_durable: Callable[[WriteJob], None]) -> None:
        self._cold = cold
        self._on_durable = on_durable
        self._queue: queue.Queue[WriteJob | None] = queue.Queue()
        self._lock = threading.Condition()
        self._pending: dict[tuple[str, tuple[int, ...]], WriteJob] = {}
        self.written = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="mlxkv-write-behind", daemon=True)
        self._thread.start()

    def submit(self, tokens: Sequence[int], caches: list[LayerCache], ns: str) -> None:
        job = WriteJob(tuple(tokens), caches, ns, sum(c.nbytes for c in caches))
        with self._lock:
            if (ns, job.tokens) in self._pending:
                return
            self._pending[(ns, job.tokens)] = job
        self._queue.put(job)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return sum(j.nbytes for j in self._pending.values())

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted write has finished; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float | None = None) -> bool:
        done = self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        return done

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                ok = self._cold.store(job.tokens, job.caches, job.ns)
            except Exception as e:  # noqa: BLE001 - the writer thread must survive any store fault
                log.warning("write-behind of %d tokens failed: %s", len(job.tokens), e)
                ok = False
            if ok:
                self.written += 1
                self._on_durable(job)
            else:
                self.failed += 1
            with self._lock:
                self._pending.pop((job.ns, job.tokens), None)
                self._lock.notify_all()
