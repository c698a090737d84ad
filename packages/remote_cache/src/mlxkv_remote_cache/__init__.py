"""mlxkv remote tier: KV entries (the SSD files' bytes) shared by replicas through Redis/Valkey or S3."""

from __future__ import annotations

from urllib.parse import urlsplit

from mlxkv_remote_cache.backend import IndexEvents, RemoteBackend
from mlxkv_remote_cache.breaker import CircuitBreaker
from mlxkv_remote_cache.errors import RemoteCacheError, RemoteObjectError, RemoteUnavailableError
from mlxkv_remote_cache.manifest import Manifest
from mlxkv_remote_cache.mirror import IndexMirror, MirrorListener
from mlxkv_remote_cache.redis_backend import RedisBackend, safe_url
from mlxkv_remote_cache.s3_backend import S3Backend
from mlxkv_remote_cache.store import EntryInfo, RemoteConfig, RemoteStats, RemoteStore


def open_backend(url: str) -> RemoteBackend:
    """The backend `url` names: redis://, rediss:// (TLS) or unix:// (Redis, Valkey), or s3://bucket/prefix."""
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        return RedisBackend(url)
    if scheme == "s3":
        return S3Backend(url)
    raise ValueError(f"remote cache {safe_url(url)!r}: give redis://host:port, rediss://user:password@host:port "
                     "or s3://bucket/prefix")


__all__ = [
    "CircuitBreaker", "EntryInfo", "IndexEvents", "IndexMirror", "Manifest", "MirrorListener", "RedisBackend",
    "RemoteBackend", "RemoteCacheError", "RemoteConfig", "RemoteObjectError", "RemoteStats", "RemoteStore",
    "RemoteUnavailableError", "S3Backend", "open_backend", "safe_url",
]
