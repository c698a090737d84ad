"""Progress of long work: a status line on a terminal's stderr (nothing when stderr is not a
terminal), and info log lines for a server's long prefills."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("mlxkv.progress")
Clock = Callable[[], float]
LOG_PREFILL_AFTER_S = 5.0


class PrefillRate:
    """Tokens per second of one prefill, timed from its (0, total) report."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._start: float | None = None

    def elapsed(self, done: int) -> float:
        now = self._clock()
        if done == 0 or self._start is None:
            self._start = now
        return now - self._start

    @staticmethod
    def line(done: int, total: int, elapsed: float) -> str:
        rate = f", {done / elapsed:.1f} tok/s" if done and elapsed > 0 else ""
        return f"prefill {done}/{total} tokens{rate}"


class TerminalProgress:
    """One self-overwriting status line on `stream`, only when it is a terminal."""

    def __init__(self, stream: TextIO | None = None, clock: Clock = time.monotonic) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = self._stream.isatty()
        self._rate = PrefillRate(clock)
        self._shown = False

    def status(self, text: str) -> None:
        if self.enabled:
            self._stream.write(f"\r\x1b[K{text}")
            self._stream.flush()
            self._shown = True

    def clear(self) -> None:
        """Remove the status line (before other output goes to the terminal)."""
        if self._shown:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._shown = False

    def prefill(self, done: int, total: int) -> None:
        """A `PrefillProgress` callback; the line goes once the prefill is done."""
        elapsed = self._rate.elapsed(done)
        if done < total:
            self.status(PrefillRate.line(done, total, elapsed))
        else:
            self.clear()


class PrefillLog:
    """A `PrefillProgress` callback logging a prefill at info, every chunk once it has run for
    `after_s` (short prefills log nothing)."""

    def __init__(self, name: str, after_s: float = LOG_PREFILL_AFTER_S, clock: Clock = time.monotonic) -> None:
        self._name = name
        self._after_s = after_s
        self._rate = PrefillRate(clock)

    def __call__(self, done: int, total: int) -> None:
        elapsed = self._rate.elapsed(done)
        if done and elapsed >= self._after_s:
            log.info("%s: %s after %.0f s", self._name, PrefillRate.line(done, total, elapsed), elapsed)
