"""`RemoteStore`: whole entries (the SSD file's bytes) in a shared backend, behind a circuit breaker.

    put:  parts under this writer's token (first writer wins per key), then the manifest (SET NX /
          If-None-Match: *): the commit point; a losing writer deletes its parts
    get:  manifest (capped) -> checked -> every part (capped, digest) -> TTLs refreshed; on a store
          whose keys do not expire (S3) a manifest written more than the TTL ago is a miss
    every backend call goes through the breaker: when it is open nothing is asked, and the call
    fails at once (a miss for reads, a write left out for writes)
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import xxhash

from mlxkv_remote_cache.backend import IndexEvents, RemoteBackend
from mlxkv_remote_cache.breaker import CircuitBreaker
from mlxkv_remote_cache.errors import RemoteObjectError, RemoteUnavailableError
from mlxkv_remote_cache.keys import (
    LATEST, MANIFEST, checkpoint_prefix, entry_prefix, events_channel, identity_prefix, is_prompt_manifest, part_key,
)
from mlxkv_remote_cache.manifest import MAX_MANIFEST_BYTES, Kind, Manifest, decode_manifest

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TTL_S = 7 * 24 * 3600
DEFAULT_PART_BYTES = 8 << 20
DEFAULT_MAX_ENTRY_BYTES = 4 << 30
MAX_EVENTS = 100_000


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    ttl_s: int = DEFAULT_TTL_S
    part_bytes: int = DEFAULT_PART_BYTES
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    hmac_key: bytes | None = None  # set: entries are signed, and unsigned or badly signed ones are misses

    def __post_init__(self) -> None:
        if self.ttl_s < 1:
            raise ValueError(f"ttl_s={self.ttl_s} must be >= 1 second")
        if not 0 < self.part_bytes <= self.max_entry_bytes:
            raise ValueError(f"part_bytes={self.part_bytes} must be in (0, max_entry_bytes={self.max_entry_bytes}]")
        if self.hmac_key is not None and len(self.hmac_key) < 16:
            raise ValueError(f"the HMAC key has {len(self.hmac_key)} bytes; give at least 16")


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """What a replica knows of an entry without reading it (the index mirror's record)."""

    ns_key: str
    manifest: Manifest


@dataclass(frozen=True, slots=True)
class RemoteStats:
    gets: int
    get_bytes: int
    get_seconds: float
    puts: int
    put_bytes: int
    failures: int  # backend calls that failed (timeouts, refused connections)
    skipped: int  # calls not made: the breaker was open
    bad_objects: int  # objects read back that failed a check
    breaker_opened: int
    expired: int = 0  # manifests read past their TTL on a store that keeps keys (S3): misses


class RemoteStore:
    def __init__(self, backend: RemoteBackend, identity_key: str, config: RemoteConfig = RemoteConfig(),
                 breaker: CircuitBreaker | None = None, clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.identity_key = identity_key
        self.config = config
        self.breaker = breaker or CircuitBreaker()
        self.writer = secrets.token_hex(8)  # this process's parts and manifests carry it
        self._clock = clock  # wall time: manifests carry their writer's `created_at`
        self._lock = threading.Lock()
        self._counts = {"gets": 0, "get_bytes": 0, "puts": 0, "put_bytes": 0, "failures": 0, "skipped": 0, "bad_objects": 0,
                        "expired": 0}
        self._get_seconds = 0.0

    @property
    def events(self) -> IndexEvents | None:
        return self.backend if isinstance(self.backend, IndexEvents) else None

    # -- prompt entries --------------------------------------------------------------------------
    def put_entry(self, ns_key: str, entry_id: str, ns: str, tokens: Sequence[int], data: bytes,
                  minimum_reusable_offset: int, trimmable: bool) -> bool:
        """Store an entry unless one of its name exists; True when this call wrote it. Raises
        `RemoteUnavailableError` when the backend is down (or the breaker open)."""
        base = entry_prefix(self.identity_key, ns_key, entry_id)
        manifest = self._manifest("prompt", entry_id, ns, tokens, data, minimum_reusable_offset, trimmable)
        written = self._put(base, manifest, data, overwrite=False)
        if written:
            self._announce(b"put " + (base + MANIFEST).encode())
        return written

    def get_entry(self, info: EntryInfo) -> bytes | None:
        """The entry's bytes, every part checked; None when it is gone, incomplete or fails a
        check (counted in `bad_objects`). Raises `RemoteUnavailableError` when the backend is down."""
        base = entry_prefix(self.identity_key, info.ns_key, info.manifest.name)
        manifest = self._read_manifest(base + MANIFEST)
        if manifest is None or manifest.kind != "prompt" or manifest.name != info.manifest.name:
            return None
        return self._read_parts(base, manifest)

    def remove_entry(self, info: EntryInfo) -> bool:
        """Delete an entry this process wrote (never another's: a bad entry someone else wrote
        is only skipped); True when deleted."""
        if info.manifest.writer != self.writer:
            return False
        base = entry_prefix(self.identity_key, info.ns_key, info.manifest.name)
        self._guarded(lambda: self.backend.delete([base + MANIFEST, *self._part_keys(base, info.manifest)]))
        self._announce(b"del " + (base + MANIFEST).encode())
        return True

    def list_entries(self) -> list[EntryInfo]:
        """Every prompt entry of this identity (a listing and one manifest read each)."""
        keys = self._guarded(lambda: self.backend.list(identity_prefix(self.identity_key)))
        return [info for key in keys if is_prompt_manifest(self.identity_key, key) and (info := self.entry_at(key)) is not None]

    def entry_at(self, manifest_key: str) -> EntryInfo | None:
        manifest = self._read_manifest(manifest_key)
        if manifest is None or manifest.kind != "prompt":
            return None
        ns_key = manifest_key.removeprefix(identity_prefix(self.identity_key)).split("/")[0]
        return EntryInfo(ns_key, manifest)

    # -- generation checkpoints ------------------------------------------------------------------
    def save_checkpoint(self, request_key: str, ns: str, tokens: Sequence[int], data: bytes) -> bool:
        """A new version of the request's checkpoint, then the pointer to it; the previous version
        (if this process wrote it) is deleted after the pointer moved."""
        base = checkpoint_prefix(self.identity_key, request_key)
        version = f"{self.writer}{len(tokens):08x}"
        manifest = self._manifest("checkpoint", request_key, ns, tokens, data, 0, False)
        previous = self._latest(base)
        if not self._put(f"{base}{version}/", manifest, data, overwrite=True):
            return False
        self._guarded(lambda: self.backend.put(base + LATEST, version.encode(), self.config.ttl_s))
        if previous is not None and previous != version and previous.startswith(self.writer):
            old = self._read_manifest(f"{base}{previous}/{MANIFEST}")
            if old is not None:
                self._guarded(lambda: self.backend.delete([f"{base}{previous}/{MANIFEST}",
                                                            *self._part_keys(f"{base}{previous}/", old)]))
        return True

    def load_checkpoint(self, request_key: str) -> bytes | None:
        base = checkpoint_prefix(self.identity_key, request_key)
        version = self._latest(base)
        if version is None:
            return None
        manifest = self._read_manifest(f"{base}{version}/{MANIFEST}")
        if manifest is None or manifest.kind != "checkpoint" or manifest.name != request_key:
            return None
        return self._read_parts(f"{base}{version}/", manifest)

    def remove_checkpoint(self, request_key: str) -> None:
        base = checkpoint_prefix(self.identity_key, request_key)
        version = self._latest(base)
        if version is None:
            return
        manifest = self._read_manifest(f"{base}{version}/{MANIFEST}")
        parts = self._part_keys(f"{base}{version}/", manifest) if manifest is not None else []
        self._guarded(lambda: self.backend.delete([base + LATEST, f"{base}{version}/{MANIFEST}", *parts]))

    # -- state -------------------------------------------------------------------------------------
    def stats(self) -> RemoteStats:
        with self._lock:
            c = dict(self._counts)
            seconds = self._get_seconds
        return RemoteStats(c["gets"], c["get_bytes"], seconds, c["puts"], c["put_bytes"], c["failures"], c["skipped"],
                           c["bad_objects"], self.breaker.opened, c["expired"])

    def healthy(self) -> bool:
        return self.breaker.state == "closed"

    def probe(self) -> bool:
        """One cheap call (a missing key), through the breaker; whether the backend answered."""
        try:
            self._guarded(lambda: self.backend.get(identity_prefix(self.identity_key) + "probe", 1, 1))
            return True
        except RemoteUnavailableError:
            return False
        except RemoteObjectError:
            return True

    def count_bad(self) -> None:
        self._count("bad_objects")

    def guarded(self, call: Callable[[], T]) -> T:
        """`call` through the breaker (for backend calls made by the index mirror)."""
        return self._guarded(call)

    # -- internals ---------------------------------------------------------------------------------
    def _manifest(self, kind: Kind, name: str, ns: str, tokens: Sequence[int], data: bytes,
                  minimum_reusable_offset: int, trimmable: bool) -> Manifest:
        if not data or len(data) > self.config.max_entry_bytes:
            raise ValueError(f"an entry of {len(data)} bytes is outside (0, {self.config.max_entry_bytes}]")
        step = self.config.part_bytes
        view = memoryview(data)
        sizes = tuple(min(step, len(data) - at) for at in range(0, len(data), step))
        digests = tuple(xxhash.xxh3_128_hexdigest(view[at : at + step]) for at in range(0, len(data), step))
        key = self.config.hmac_key
        manifest = Manifest(kind, name, ns, tuple(tokens), minimum_reusable_offset, trimmable, len(data), sizes, digests,
                            hashlib.sha256(data).hexdigest() if key else None, self.writer, self._clock())
        return manifest.signed(key) if key else manifest

    def _put(self, base: str, manifest: Manifest, data: bytes, *, overwrite: bool) -> bool:
        ttl, step = self.config.ttl_s, self.config.part_bytes
        if not overwrite and self._guarded(lambda: self.backend.get(base + MANIFEST, MAX_MANIFEST_BYTES, ttl)) is not None:
            return False  # someone wrote it first: no parts uploaded for nothing
        parts = self._part_keys(base, manifest)
        for i, key in enumerate(parts):
            chunk = data[i * step : (i + 1) * step]
            self._guarded(lambda: self.backend.put(key, chunk, ttl))
        if overwrite:  # a checkpoint version: only this process writes under its name
            self._guarded(lambda: self.backend.put(base + MANIFEST, manifest.encode(), ttl))
            committed = True
        else:
            committed = self._guarded(lambda: self.backend.put_if_absent(base + MANIFEST, manifest.encode(), ttl))
        if not committed:
            self._guarded(lambda: self.backend.delete(parts))  # our parts: the winner's manifest names its own
            return False
        with self._lock:
            self._counts["puts"] += 1
            self._counts["put_bytes"] += len(data)
        return True

    def _read_manifest(self, key: str) -> Manifest | None:
        try:
            data = self._guarded(lambda: self.backend.get(key, MAX_MANIFEST_BYTES, self.config.ttl_s))
            if data is None:
                return None
            manifest = decode_manifest(data, self.config.max_entry_bytes, self.config.part_bytes)
            if self.config.hmac_key is not None and not manifest.signature_ok(self.config.hmac_key):
                raise RemoteObjectError(f"{key}: missing or bad signature")
            if not self.backend.expires_keys and self._clock() - manifest.created_at > self.config.ttl_s:
                self._count("expired")  # stale, not bad: the bucket's lifecycle rule removes it
                return None
            return manifest
        except RemoteObjectError as e:
            log.warning("remote manifest refused: %s", e)
            self._count("bad_objects")
            return None

    def _read_parts(self, base: str, manifest: Manifest) -> bytes | None:
        started = time.monotonic()
        out = bytearray()
        ttl = self.config.ttl_s
        try:
            for key, size, digest in zip(self._part_keys(base, manifest), manifest.part_sizes, manifest.part_digests):
                part = self._guarded(lambda: self.backend.get(key, size, ttl))
                if part is None:
                    raise RemoteObjectError(f"{key} is gone (evicted?) behind a present manifest")
                if len(part) != size or xxhash.xxh3_128_hexdigest(part) != digest:
                    raise RemoteObjectError(f"{key} does not match its manifest ({len(part)} of {size} bytes, or its digest)")
                out += part
            if manifest.sha256 is not None and hashlib.sha256(out).hexdigest() != manifest.sha256:
                raise RemoteObjectError(f"{base}: the entry's sha256 differs from its manifest's")
        except RemoteObjectError as e:
            log.warning("remote entry refused: %s", e)
            self._count("bad_objects")
            return None
        with self._lock:
            self._counts["gets"] += 1
            self._counts["get_bytes"] += len(out)
            self._get_seconds += time.monotonic() - started
        return bytes(out)

    def _latest(self, base: str) -> str | None:
        try:
            data = self._guarded(lambda: self.backend.get(base + LATEST, 64, self.config.ttl_s))
        except RemoteObjectError:
            self._count("bad_objects")
            return None
        version = data.decode(errors="replace") if data is not None else None
        return version if version is not None and version.isalnum() else None

    def _announce(self, record: bytes) -> None:
        events = self.events
        if events is not None:
            self._guarded(lambda: events.announce(events_channel(self.identity_key), record, MAX_EVENTS, self.config.ttl_s))

    def _part_keys(self, base: str, manifest: Manifest) -> list[str]:
        return [part_key(base, manifest.writer, i) for i in range(len(manifest.part_sizes))]

    def _guarded(self, call: Callable[[], T]) -> T:
        if not self.breaker.allow():
            self._count("skipped")
            raise RemoteUnavailableError(f"{self.backend.url}: circuit open (the backend failed; probing again later)")
        try:
            result = call()
        except RemoteUnavailableError:
            self.breaker.failed()
            self._count("failures")
            raise
        except BaseException:
            self.breaker.succeeded()  # the backend answered (with something we refuse)
            raise
        self.breaker.succeeded()
        return result

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1
