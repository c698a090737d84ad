"""The `ColdTier` Protocol: what the RAM prompt cache needs from a durable tier below it.

Declared here, by its consumer; the app binds the SSD store to it (apps/mlxkv/engine/cache_services.py).
`find` does no I/O; `restore` returns None on any failure; `store` returns False on any failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from mlxkv_inference.cache.factory import LayerCache


@dataclass(frozen=True, slots=True)
class ColdHit:
    """A usable prefix found in the cold tier's index (an opaque handle for `restore`)."""

    handle: str
    ns: str
    num_tokens: int
    entry_tokens: int


@dataclass(frozen=True, slots=True)
class ColdRestored:
    """Caches covering `tokens`."""

    caches: list[LayerCache]
    tokens: tuple[int, ...]


class ColdTier(Protocol):
    def find(self, prompt: Sequence[int], ns: str) -> ColdHit | None: ...

    def find_exact(self, tokens: Sequence[int], ns: str) -> ColdHit | None: ...

    def restore(self, hit: ColdHit) -> ColdRestored | None: ...

    def restore_async(self, hit: ColdHit) -> Future[ColdRestored | None]: ...

    def store(self, tokens: Sequence[int], caches: Sequence[LayerCache], ns: str) -> bool: ...
