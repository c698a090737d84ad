"""What a forward of L positions costs on this machine, measured as generations run: the
speculative draft length and the scheduler's prefill timing read it."""

from __future__ import annotations

import threading

PRIOR_POSITION_COST = 0.15  # cost of one more verified position, as a fraction of a step, until measured


class StepCosts:
    """Seconds per forward (alone or batched) of `rows` positions in all (decayed averages),
    shared by a binding's generations."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._lock = threading.Lock()
        # seconds(rows) as worked out since the last measurement: every generation's draft length
        # asks for each candidate length, twice a step.
        self._worked_out: dict[int, float | None] = {}

    def record(self, rows: int, seconds: float) -> None:
        with self._lock:
            previous = self._seconds.get(rows)
            self._seconds[rows] = seconds if previous is None else 0.8 * previous + 0.2 * seconds
            self._worked_out = {}

    def replace(self, rows: int, seconds: float) -> None:
        """Forget what `rows` measured before (a calibration of another kind of forward)."""
        with self._lock:
            self._seconds[rows] = seconds
            self._worked_out = {}

    def seconds(self, rows: int) -> float | None:
        """Measured seconds for `rows`, else interpolated (or extrapolated) from the nearest
        measured row counts, never below what fewer rows measured (more rows never cost less;
        noisy timings could extrapolate to nothing); None before two row counts are measured."""
        with self._lock:
            worked_out = self._worked_out  # a measurement from now on replaces it, unread
            if rows in worked_out:
                return worked_out[rows]
            known = sorted(self._seconds.items())
        worked_out[rows] = seconds = self._work_out(known, rows)
        return seconds

    @staticmethod
    def _work_out(known: list[tuple[int, float]], rows: int) -> float | None:
        exact = dict(known).get(rows)
        if exact is not None or len(known) < 2:
            return exact
        below = [p for p in known if p[0] < rows]
        above = [p for p in known if p[0] > rows]
        (r0, t0), (r1, t1) = (below[-1], above[0]) if below and above else (known[-2:] if below else known[:2])
        floor = max(t for _, t in below) if below else known[0][1] * rows / known[0][0]
        return max(t0 + (t1 - t0) * (rows - r0) / (r1 - r0), floor)

    def relative(self, rows: int, base: int = 1) -> float:
        """What a forward of `rows` positions costs against one of `base` positions."""
        if rows <= base:
            return 1.0
        few, many = self.seconds(base), self.seconds(rows)
        if few is None or many is None or few <= 0:
            return 1.0 + PRIOR_POSITION_COST * (rows - base) / base
        return max(many / few, 1.0)
