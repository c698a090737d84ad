"""What the remote tier needs from a key-value store: five calls, each with a byte limit or a TTL.

Every call either answers or raises `RemoteUnavailableError` promptly (short socket timeouts, no
retries): the request path never waits on a slow store. An absent key is `None` / `False`, not an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


class RemoteBackend(Protocol):
    """A shared byte store (Redis/Valkey, S3)."""

    url: str  # where it is, without credentials (for logs)
    expires_keys: bool  # True: the store drops a key `ttl_s` after its last write or hit (Redis);
    # False: it keeps keys until deleted or a lifecycle rule removes them (S3), so readers check age

    def get(self, key: str, max_bytes: int, ttl_s: int) -> bytes | None:
        """The object, or None when absent; `RemoteObjectError` when it is larger than `max_bytes`
        (checked before its bytes are read). A hit refreshes the key's TTL where the store has one."""
        ...

    def put_if_absent(self, key: str, data: bytes, ttl_s: int) -> bool:
        """Store `data` unless the key exists (first writer wins); False when it did."""
        ...

    def put(self, key: str, data: bytes, ttl_s: int) -> None:
        """Store `data`, replacing what the key held (pointers that move: a checkpoint's newest version)."""
        ...

    def delete(self, keys: Sequence[str]) -> None: ...

    def touch(self, keys: Sequence[str], ttl_s: int) -> None:
        """Refresh the TTL of `keys` (a hit keeps an entry's parts alive as long as its manifest)."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Every key under `prefix` (a replica's start-up snapshot and periodic poll)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class IndexEvents(Protocol):
    """An optional ability: a log of index changes other replicas follow between two listings
    (Redis streams); stores without one are polled."""

    def announce(self, channel: str, record: bytes, max_records: int, ttl_s: int) -> None:
        """Append `record` (the log keeps about `max_records`, and lives `ttl_s` after the last)."""
        ...

    def follow(self, channel: str, after: str, block_ms: int) -> tuple[str, list[bytes]]:
        """Records appended after position `after` ("$" for "from now"), waiting up to
        `block_ms`; returns the new position and the records."""
        ...
