"""A generation's clock: its time to first token and rates, and the seconds of each step it
drives alone, which the binding's step costs learn from."""

from __future__ import annotations

import time

from mlxkv_inference.step_costs import StepCosts


class StepTimer:
    def __init__(self) -> None:
        self._t0 = 0.0
        self._t_first = 0.0
        self._t_end = 0.0
        self._alone_since = 0.0  # when a step this generation drives alone started (0: batched, or untimed)

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def first_token(self) -> None:
        self._t_first = time.perf_counter()

    def end(self) -> None:
        self._t_end = time.perf_counter()

    def step_alone(self) -> None:
        self._alone_since = time.perf_counter()

    def untimed(self) -> None:
        """Leave the open step out of the step costs (a compiled trace ran in it: its size would
        be off for good)."""
        self._alone_since = 0.0

    def record(self, costs: StepCosts, rows: int) -> None:
        """Record the open step (of `rows` positions) in `costs`, where it ran alone and timed."""
        if self._alone_since:
            costs.record(rows, time.perf_counter() - self._alone_since)
            self._alone_since = 0.0

    def rates(self, prefilled: int, decoded: int) -> tuple[float, float, float]:
        """Time to first token, prefill and decode tokens a second (`decoded`: in this run)."""
        ttft = self._t_first - self._t0
        decode_time = self._t_end - self._t_first
        prefill_tps = prefilled / ttft if ttft > 0 else 0.0
        return ttft, prefill_tps, (decoded - 1) / decode_time if decoded > 1 and decode_time > 0 else 0.0
