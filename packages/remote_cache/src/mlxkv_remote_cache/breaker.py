"""A circuit breaker: after `failures_to_open` failures in a row the backend is not asked for
`open_s` seconds; then one call probes it (half-open): success closes the breaker, failure opens it again.

    closed --N failures--> open --open_s--> half-open --ok--> closed
                                                      --fail--> open
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

State = Literal["closed", "open", "half-open"]


class CircuitBreaker:
    def __init__(self, failures_to_open: int = 3, open_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if failures_to_open < 1:
            raise ValueError(f"failures_to_open={failures_to_open} must be >= 1")
        if not open_s > 0:
            raise ValueError(f"open_s={open_s} must be > 0 seconds")
        self.failures_to_open = failures_to_open
        self.open_s = open_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state: State = "closed"
        self._failures = 0
        self._opened_at = 0.0
        self.opened = 0  # times it opened

    @property
    def state(self) -> State:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """Whether a call may go to the backend now (True once per open period, as the probe)."""
        with self._lock:
            if self._state == "closed":
                return True
            if self._state == "open" and self._clock() - self._opened_at >= self.open_s:
                self._state = "half-open"
                return True
            return False

    def succeeded(self) -> None:
        with self._lock:
            self._state, self._failures = "closed", 0

    def failed(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state == "half-open" or self._failures >= self.failures_to_open:
                if self._state != "open":
                    self.opened += 1
                self._state, self._opened_at = "open", self._clock()
