"""Redis / Valkey backend (redis-py): `redis://`, `rediss://` (TLS), ACL `user:password@` in the URL.

Retries are off and socket timeouts short: redis-py's default retries took seconds to fail against a
dead port; one failed call here costs one timeout at most, and the breaker stops the next ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mlxkv_remote_cache.errors import RemoteObjectError, RemoteUnavailableError

T = TypeVar("T")
Records = list[bytes]
DEFAULT_TIMEOUT_S = 0.5
DEFAULT_WRITE_TIMEOUT_S = 10.0  # writes run behind the requests: a 100 MB part may take a while
_FOLLOW_MARGIN_S = 2.0

# One round trip: the size is checked before a byte of the value crosses the network, and a hit
# refreshes the TTL. Returns nil (absent), the size (too large) or the value.
_CAPPED_GET = """
local n = redis.call('STRLEN', KEYS[1])
if n == 0 and redis.call('EXISTS', KEYS[1]) == 0 then return false end
if n > tonumber(ARGV[1]) then return n end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return redis.call('GET', KEYS[1])
"""


class RedisBackend:
    expires_keys = True

    def __init__(self, url: str, timeout_s: float = DEFAULT_TIMEOUT_S, write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"{safe_url(url)!r} is not a redis://, rediss:// or unix:// URL")
        self.url = safe_url(url)
        options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                       retry_on_timeout=False, health_check_interval=0)
        self._client = redis.Redis.from_url(url, **options)
        self._writer = redis.Redis.from_url(url, **{**options, "socket_timeout": write_timeout_s})
        # XREAD BLOCK waits on its own connections, with a timeout longer than the block.
        self._follower = redis.Redis.from_url(url, **{**options, "socket_timeout": timeout_s + _FOLLOW_MARGIN_S})
        self._get = self._client.register_script(_CAPPED_GET)
        self._positions: dict[str, str] = {}

    def get(self, key: str, max_bytes: int, ttl_s: int) -> bytes | None:
        found = self._call(lambda: self._get(keys=[key], args=[max_bytes, ttl_s]))
        if found is None:
            return None
        if isinstance(found, int):
            raise RemoteObjectError(f"{key} holds {found} bytes, more than the {max_bytes}-byte limit")
        assert isinstance(found, bytes)
        return found

    def put_if_absent(self, key: str, data: bytes, ttl_s: int) -> bool:
        return bool(self._call(lambda: self._writer.set(key, data, nx=True, ex=ttl_s)))

    def put(self, key: str, data: bytes, ttl_s: int) -> None:
        self._call(lambda: self._writer.set(key, data, ex=ttl_s))

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            self._call(lambda: self._writer.delete(*keys))

    def touch(self, keys: Sequence[str], ttl_s: int) -> None:
        def expire_all() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.expire(key, ttl_s)
            pipe.execute()
        if keys:
            self._call(expire_all)

    def list(self, prefix: str) -> list[str]:
        pattern = prefix.replace("\\", "\\\\").replace("*", "\\*").replace("?", "\\?").replace("[", "\\[") + "*"
        return self._call(lambda: [k.decode() for k in self._client.scan_iter(match=pattern, count=1000)])

    def announce(self, channel: str, record: bytes, max_records: int, ttl_s: int) -> None:
        def append() -> None:
            pipe = self._writer.pipeline(transaction=False)
            pipe.xadd(channel, {"r": record}, maxlen=max_records, approximate=True)
            pipe.expire(channel, ttl_s)
            pipe.execute()
        self._call(append)

    def follow(self, channel: str, after: str, block_ms: int) -> tuple[str, Records]:
        if after == "$":  # "from now": the stream's last id, so no record between two calls is lost
            last: Any = self._call(lambda: self._follower.xrevrange(channel, count=1))
            after = last[0][0].decode() if last else "0-0"
        read: Any = self._call(lambda: self._follower.xread({channel: after}, count=1000, block=block_ms))
        records: Records = []
        for _, entries in read or []:
            for entry_id, fields in entries:
                after = entry_id.decode()
                records.append(fields[b"r"])
        return after, records

    def close(self) -> None:
        for client in (self._client, self._writer, self._follower):
            client.close()

    def _call(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except (redis.RedisError, OSError) as e:
            raise RemoteUnavailableError(f"{self.url}: {type(e).__name__}: {e}") from e


def safe_url(url: str) -> str:
    """`url` without its user and password (for logs and errors)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
