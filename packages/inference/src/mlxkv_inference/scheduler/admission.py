"""Which waiting request joins the running batch, and when.

    room        running requests + SSD reads in flight < max_batch
    KV budget   a request joins the others only while all their KV (prompt + max_tokens, at the
                model's KV bytes a token) fits `max_kv_bytes` (0: no limit); a request alone
                always runs. One that does not fit is held, and joins first once it fits.
    read-ahead  a prompt whose prefix is on the SSD (longer than RAM's) is read off the worker
                thread first; the request joins once its read is in (`ready`).

The caller owns the queue and the thread; `Admission` decides, the caller starts what it is told.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Generic, Protocol, TypeVar

from mlxkv_inference.prompt_cache import ColdRestored, TieredPromptCache

log = logging.getLogger(__name__)

READ_POLL_S = 0.05  # how long an idle worker waits on SSD reads before it looks at the queue again


class Waiting(Protocol):
    """What admission needs of a waiting request."""

    @property
    def prompt(self) -> Sequence[int]: ...

    @property
    def max_tokens(self) -> int: ...

    @property
    def cancelled(self) -> bool: ...

    @property
    def ns(self) -> str: ...  # the adapter namespace its cached prefix must carry


R = TypeVar("R", bound=Waiting)


class Admission(Generic[R]):
    def __init__(self, max_batch: int, max_kv_bytes: int = 0, tiers: TieredPromptCache | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max batch={max_batch} must be >= 1")
        if max_kv_bytes < 0:
            raise ValueError(f"max batch KV bytes={max_kv_bytes} must be >= 0 (0: no limit)")
        self.max_batch = max_batch
        self.max_kv_bytes = max_kv_bytes
        self.kv_bytes_per_token = 0  # learned from the running caches (`learn_kv_bytes_per_token`)
        self._tiers = tiers
        self._held: R | None = None
        self._reading: list[tuple[R, Future[ColdRestored | None]]] = []

    @property
    def reading(self) -> int:
        """Requests whose SSD read is in flight (admitted, not started)."""
        return len(self._reading)

    def has_room(self, running: int) -> bool:
        return running + len(self._reading) < self.max_batch

    def take_held(self) -> R | None:
        """The request held back for KV room (it goes before the queue), no longer held."""
        held, self._held = self._held, None
        return held

    def can_admit(self, request: R, running: Sequence[R]) -> bool:
        """Whether `request` may join `running` (and the reads in flight) within the KV budget."""
        return self._kv_fits(request, running)

    def hold(self, request: R) -> None:
        """Keep `request`, which may not join yet, to go before the queue (`take_held`)."""
        assert self._held is None, "one request is held at a time"
        self._held = request

    def admit(self, request: R) -> bool:
        """Admit `request`: True when it starts now, False when its SSD prefix is being read
        first (`ready` hands it back with the read)."""
        if self._tiers is None or request.cancelled:
            return True
        hit = self._tiers.cold_hit(request.prompt, request.ns)
        if hit is None:
            return True
        self._reading.append((request, self._tiers.read_cold(hit)))
        return False

    def ready(self) -> list[tuple[R, ColdRestored | None]]:
        """The requests whose SSD read is in, with what it read (None: it failed, the prompt is
        served from RAM or prefilled), in admission order."""
        done = [r for r in self._reading if r[1].done()]
        for entry in done:
            self._reading.remove(entry)
        return [(request, _read_result(read)) for request, read in done]

    def wait_for_reads(self, timeout: float = READ_POLL_S) -> None:
        """Block until a read is in or `timeout` passes (an idle worker, between looks at the queue)."""
        wait([read for _, read in self._reading], timeout, FIRST_COMPLETED)

    def arriving(self, running: int, head: R | None) -> int | None:
        """The prompt tokens of the request the next admission pass would start (`head`, the
        next in the queue, when there is room; else the shortest whose read is in), for a step's
        prefill to give way to it (`BatchScheduler.step`); None when none would."""
        if head is not None and self._held is None and self.has_room(running) and not head.cancelled:
            return len(head.prompt)
        return min((len(request.prompt) for request, read in self._reading if read.done()), default=None)

    def learn_kv_bytes_per_token(self, running: Iterable[int]) -> None:
        """Learn the model's KV bytes a token from the running generations' caches, once one
        holds a token (0 until then: the budget cannot be judged, so every request fits)."""
        if not self.kv_bytes_per_token:
            self.kv_bytes_per_token = max(running, default=0)

    def _kv_fits(self, request: R, running: Sequence[R]) -> bool:
        others = [*running, *(r for r, _ in self._reading)]
        if not others or not self.max_kv_bytes or not self.kv_bytes_per_token:
            return True
        tokens = sum(len(r.prompt) + r.max_tokens for r in [*others, request])
        return tokens * self.kv_bytes_per_token <= self.max_kv_bytes


def _read_result(read: Future[ColdRestored | None]) -> ColdRestored | None:
    error = read.exception()
    if error is not None:
        log.warning("prompt cache read failed: %s: %s", type(error).__name__, error)
        return None
    return read.result()
