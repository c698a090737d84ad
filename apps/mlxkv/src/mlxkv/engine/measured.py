"""What the process really holds, beside what the memory budget planned: the gauge that reads it
(anonymous resident memory from /proc/self/statm and MLX's allocator figures) and the status that
admission compares against the budget and /health and refusals report.

    planned   weights + RAM tier caps + the running requests' planned KV (what admission counted)
    measured  the process's memory now (RSS less file-backed pages, or MLX's figures where larger)
    in use    max(planned, measured) = planned + the measured memory no plan accounts for
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import mlx.core as mx

STATM = Path("/proc/self/statm")


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """One reading of the process's memory, in bytes. `rss_bytes` is None where the OS does not
    say (no /proc): MLX's figures stand for the process then."""

    rss_bytes: int | None
    mlx_active_bytes: int
    mlx_cache_bytes: int

    def __post_init__(self) -> None:
        for name in ("mlx_active_bytes", "mlx_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.rss_bytes is not None and self.rss_bytes < 0:
            raise ValueError(f"rss_bytes={self.rss_bytes} must be >= 0")

    @property
    def used_bytes(self) -> int:
        # NOTE: on Linux RSS already holds MLX's CPU buffers; on Metal the GPU's may not be in
        # it, so the larger of the two stands for the process, never their sum.
        mlx = self.mlx_active_bytes + self.mlx_cache_bytes
        return mlx if self.rss_bytes is None else max(self.rss_bytes, mlx)


@runtime_checkable
class MemoryGauge(Protocol):
    """Reads the process's memory, and lets go of what an allocator keeps cached for reuse."""

    def read(self) -> MemoryReading: ...

    def release_cache(self) -> None: ...


class ProcessMemory:
    """The real gauge: /proc/self/statm (resident less file-backed pages, which the kernel can
    drop instead of killing the process) and MLX's active and cached buffer bytes."""

    def read(self) -> MemoryReading:
        return MemoryReading(anonymous_rss(), mx.get_active_memory(), mx.get_cache_memory())

    def release_cache(self) -> None:
        mx.clear_cache()


PROCESS_MEMORY = ProcessMemory()


def anonymous_rss(statm: Path = STATM) -> int | None:
    """Resident bytes less the file-backed (shared) ones, from `statm`; None where unreadable."""
    try:
        fields = statm.read_text().split()
        return max(0, int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True, slots=True)
class MemoryStatus:
    """The budget against the plan and a reading (None: the budget counts the plan only)."""

    limit_bytes: int
    planned_bytes: int
    reading: MemoryReading | None

    @property
    def measured_bytes(self) -> int | None:
        return None if self.reading is None else self.reading.used_bytes

    @property
    def unplanned_bytes(self) -> int:
        """Measured memory beyond everything planned (interpreter, buffers, a model larger than its file)."""
        return 0 if self.reading is None else max(0, self.reading.used_bytes - self.planned_bytes)

    @property
    def in_use_bytes(self) -> int:
        return self.planned_bytes + self.unplanned_bytes

    def fits(self, more: int) -> bool:
        """Whether `more` planned bytes fit beside what is in use."""
        return self.in_use_bytes + more <= self.limit_bytes

    def describe(self) -> str:
        """The numbers, for an error message or a log line."""
        if self.reading is None:
            return f"planned {_mb(self.planned_bytes)} of the memory budget of {_mb(self.limit_bytes)} (--memory-budget)"
        return f"{self.held()}, of the memory budget of {_mb(self.limit_bytes)} (--memory-budget)"

    def held(self) -> str:
        """What the process holds against the plan (a reading is needed)."""
        r = self.reading
        assert r is not None, "held() describes a reading"
        rss = "not readable" if r.rss_bytes is None else _mb(r.rss_bytes)
        return (f"the process holds {_mb(r.used_bytes)} (RSS {rss}, MLX active {_mb(r.mlx_active_bytes)}, MLX cache "
                f"{_mb(r.mlx_cache_bytes)}), planned {_mb(self.planned_bytes)} and {_mb(self.unplanned_bytes)} beyond the plan")

    def as_json(self) -> dict[str, int | None]:
        """The figures /health shows."""
        r = self.reading
        return {"budget_bytes": self.limit_bytes, "planned_bytes": self.planned_bytes, "measured_bytes": self.measured_bytes,
                "unplanned_bytes": self.unplanned_bytes, "in_use_bytes": self.in_use_bytes,
                "rss_bytes": r.rss_bytes if r is not None else None,
                "mlx_active_bytes": r.mlx_active_bytes if r is not None else None,
                "mlx_cache_bytes": r.mlx_cache_bytes if r is not None else None}


def _mb(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"
