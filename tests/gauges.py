"""A memory gauge the test feeds readings to, for deterministic memory-budget tests."""

from __future__ import annotations

from dataclasses import replace

from mlxkv.engine.measured import MemoryReading

MIB = 1 << 20


class FedGauge:
    """Reads what the test set in `reading`; releasing MLX's cache takes its bytes out of the
    reading (RSS included), as `mx.clear_cache` does for real."""

    def __init__(self, reading: MemoryReading) -> None:
        self.reading = reading
        self.releases = 0

    def read(self) -> MemoryReading:
        return self.reading

    def release_cache(self) -> None:
        self.releases += 1
        r = self.reading
        rss = None if r.rss_bytes is None else r.rss_bytes - r.mlx_cache_bytes
        self.reading = replace(r, rss_bytes=rss, mlx_cache_bytes=0)

    def grow(self, nbytes: int) -> None:
        """The process holds `nbytes` more (fewer when negative), outside MLX."""
        r = self.reading
        self.reading = replace(r, rss_bytes=None if r.rss_bytes is None else r.rss_bytes + nbytes)


def reading_mib(rss: float, active: float = 0.0, cache: float = 0.0) -> MemoryReading:
    return MemoryReading(int(rss * MIB), int(active * MIB), int(cache * MIB))
