"""What the engine reports about its caches (the `/metrics` and `/health` numbers), and the
write-behind queues it flushes and closes: the prompt cache's and the checkpoints'."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from mlxkv_inference.prompt_cache import TieredPromptCache
from mlxkv_serve import FlushResult

from mlxkv.engine.checkpoints import CheckpointStore, CheckpointWriter
from mlxkv.engine.remote_tier import RemoteStatus

log = logging.getLogger(__name__)


class CacheReport:
    def __init__(self, tiers: TieredPromptCache | None, ssd: CheckpointStore | None, checkpoints: CheckpointWriter | None,
                 remote: RemoteStatus | None) -> None:
        self._tiers = tiers
        self._ssd = ssd
        self._checkpoints = checkpoints
        self._remote = remote

    def cache_stats(self) -> Mapping[str, int | float]:
        out: dict[str, int | float] = {}
        if self._tiers is not None:
            stats = self._tiers.stats()
            out.update({name: getattr(stats, name) for name in stats.__dataclass_fields__})
        if self._ssd is not None:
            ssd = self._ssd.stats()
            out.update({f"ssd_{name}": getattr(ssd, name) for name in ssd.__dataclass_fields__})
        if self._checkpoints is not None:
            out["checkpoints_written"] = self._checkpoints.written
        if self._remote is not None:
            out.update(self._remote.remote_stats())
        return out

    def health(self) -> str:
        """"ok", or "degraded" while the shared cache tier does not answer (requests are served cold)."""
        return self._remote.health() if self._remote is not None else "ok"

    def flush(self, timeout: float) -> FlushResult:
        reports = [w.flush(timeout) for w in (self._checkpoints, self._tiers) if w is not None]
        remote_failed = self._remote.take_write_failures() if self._remote is not None else 0
        return FlushResult(all(r.settled for r in reports), sum(r.written for r in reports), sum(r.failed for r in reports),
                           remote_failed)

    def close(self, timeout: float) -> None:
        """Let the writes behind finish (within `timeout` each) and stop their threads."""
        if self._checkpoints is not None and not self._checkpoints.close(timeout).settled:
            log.warning("checkpoint writes did not finish within %.0f s", timeout)
        if self._tiers is not None and not self._tiers.close(timeout).settled:
            log.warning("prompt cache writes did not finish within %.0f s", timeout)
