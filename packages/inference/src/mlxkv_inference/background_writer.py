"""One daemon thread running write jobs in submission order, so no request waits on the disk.

Jobs carry a key. A newer job with the key of a job still queued supersedes it (the old one
never runs); with `if_absent` a job is dropped instead while its key is queued or running. Every
counter changes under one lock, and `flush` reports what was written and what failed since the
previous flush, so a failure is never reported as durable.

`flush` waits for the jobs submitted before it (and those they submit while they run), not for
an empty queue: writers that keep submitting (a batch of generations checkpointing every few
tokens) would otherwise hold a flush until they all stop. A job a waiting flush is owed is not
superseded (the newer job runs after it), or a key rewritten faster than the disk writes would
move the flush's goal on forever.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# A job returns True once its write is durable, False (or raises) when it failed, and None when
# there was nothing to write (a removal, say): then it counts as neither.
Work = Callable[[], bool | None]


@dataclass(frozen=True, slots=True)
class WriterStats:
    written: int
    failed: int
    superseded: int  # queued jobs replaced by a newer job with the same key before they ran
    pending: int  # queued or running
    pending_bytes: int


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What a flush saw: `settled` when every job submitted before it had finished; `written`
    and `failed` count the jobs finished since the previous flush."""

    settled: bool
    written: int
    failed: int

    @property
    def durable(self) -> bool:
        return self.settled and self.failed == 0


@dataclass(slots=True)
class _Job:
    key: Hashable
    work: Work
    nbytes: int
    seq: int  # submission order, from 1
    superseded: bool = False


class BackgroundWriter:
    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._latest: dict[Hashable, _Job] = {}  # the newest job of each key until it finishes
        self._running: _Job | None = None
        self._closed = False
        self._written = self._failed = self._superseded = 0
        self._pending = self._pending_bytes = 0
        self._reported = (0, 0)  # (written, failed) at the previous flush
        self._submitted = 0  # jobs submitted so far (the newest job's seq)
        self._passed = 0  # seq of the newest job finished or skipped (jobs pass in seq order)
        self._flushes: list[list[int]] = []  # each waiting flush's target: the seq it waits to pass
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: Hashable, work: Work, *, nbytes: int = 0, if_absent: bool = False) -> bool:
        """Queue `work` under `key`; False (and nothing queued) when `if_absent` and the key is
        queued or running. Raises `RuntimeError` after `close`."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the background writer is closed; submit before close()")
            old = self._latest.get(key)
            if old is not None and if_absent:
                return False
            self._submitted += 1
            job = _Job(key, work, nbytes, self._submitted)
            if old is not None and old is not self._running and not self._owed(old.seq):
                old.superseded = True
                self._superseded += 1
                self._pending -= 1
                self._pending_bytes -= old.nbytes
            if self._running is not None and threading.current_thread() is self._thread:
                for target in self._flushes:  # a job's own follow-up is part of it
                    if self._running.seq <= target[0]:
                        target[0] = max(target[0], job.seq)
            self._latest[key] = job
            self._queue.append(job)
            self._pending += 1
            self._pending_bytes += nbytes
            self._cond.notify_all()
        return True

    def stats(self) -> WriterStats:
        with self._cond:
            return WriterStats(self._written, self._failed, self._superseded, self._pending, self._pending_bytes)

    def flush(self, timeout: float | None = None) -> FlushReport:
        """Wait until every job submitted so far has finished (see the module docstring)."""
        with self._cond:
            target = [self._submitted]
            self._flushes.append(target)
            try:
                settled = self._cond.wait_for(lambda: self._passed >= target[0], timeout)
            finally:
                self._flushes.remove(target)
            written, failed = self._reported
            self._reported = (self._written, self._failed)
            return FlushReport(settled, self._written - written, self._failed - failed)

    def close(self, timeout: float | None = None) -> FlushReport:
        """Flush, then stop the thread once the queue is empty."""
        report = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return report

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                outcome = job.work()
            except Exception:  # noqa: BLE001 - the writer thread must outlive any single fault
                log.warning("background write %.80r failed", job.key, exc_info=True)
                outcome = False
            with self._cond:
                self._running = None
                self._passed = job.seq
                if self._latest.get(job.key) is job:
                    del self._latest[job.key]
                self._pending -= 1
                self._pending_bytes -= job.nbytes
                self._written += outcome is True
                self._failed += outcome is False
                self._cond.notify_all()

    def _next(self) -> _Job | None:
        with self._cond:
            while True:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return None
                job = self._queue.popleft()
                if not job.superseded:
                    self._running = job
                    return job
                self._passed = job.seq
                self._cond.notify_all()

    def _owed(self, seq: int) -> bool:
        return any(seq <= target[0] for target in self._flushes)
