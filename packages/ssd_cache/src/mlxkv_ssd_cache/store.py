"""`SsdCacheStore`: prompt KV states on disk, indexed in memory, under a byte cap.

    <directory>/<config_fingerprint>/<ns key or "base">/<id>.mlxkv
    <directory>/<config_fingerprint>/quarantine/<id>.mlxkv     (files that failed to read)

One store serves one model identity. Start-up reads headers only; `find` never touches the disk;
`restore` returns None on any fault and `store` returns False, so a bad disk is a cache miss.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import supersedes, usable_prefix
from mlxkv_state.errors import StateError
from mlxkv_state.header import GenerationCheckpoint, KvFileHeader
from mlxkv_ssd_cache.kv_file import Attachments, KvIdentity, build_header, read_file, read_header, write_file_atomically
from mlxkv_ssd_cache.slot_codec import SlotPolicy

log = logging.getLogger(__name__)

SUFFIX = ".mlxkv"
DIR_MODE = 0o700
TMP_GRACE_S = 60.0  # a younger .tmp may belong to a writer in another process
CHECKPOINT_DIR = "checkpoints"  # one file per request key, not part of the prompt index or its cap
OBJECT_ATTACHMENT = "object"  # an object file: no tokens, one attachment whose schema is its key


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A usable prefix of a stored entry: restoring it yields caches covering `num_tokens`."""

    entry_id: str
    ns: str
    num_tokens: int
    entry_tokens: int


@dataclass(frozen=True, slots=True)
class RestoredState:
    caches: list[LayerCache]
    tokens: tuple[int, ...]
    attachments: Attachments
    generation_checkpoint: GenerationCheckpoint | None


@dataclass(frozen=True, slots=True)
class StoreStats:
    entries: int
    bytes: int
    max_bytes: int
    quarantined: int
    evictions: int


@dataclass(slots=True)
class _Entry:
    entry_id: str
    path: Path
    ns: str
    tokens: tuple[int, ...]
    size: int
    minimum_reusable_offset: int
    trimmable: bool
    last_used: float


class SsdCacheStore:
    def __init__(self, directory: Path, identity: KvIdentity, max_bytes: int, policy: SlotPolicy = SlotPolicy()) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes} must be >= 1")
        self.identity = identity
        self.max_bytes = max_bytes
        self._policy = policy
        self._root = Path(directory).expanduser() / identity.config_fingerprint
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._quarantined = 0
        self._evictions = 0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="mlxkv-ssd-restore")
        _make_private_dir(self._root)
        self._scan()

    # -- lookup (index only) ---------------------------------------------------------------
    def find(self, prompt: Sequence[int], ns: str = "") -> CacheHit | None:
        """The longest usable stored prefix of `prompt` (at most len(prompt) - 1 tokens)."""
        best: tuple[int, float, _Entry] | None = None
        with self._lock:
            for entry in self._entries.values():
                if entry.ns != ns:
                    continue
                usable = usable_prefix(entry.tokens, prompt, entry.minimum_reusable_offset, entry.trimmable)
                if usable == 0:
                    continue
                if best is None or (usable, entry.last_used) > best[:2]:
                    best = (usable, entry.last_used, entry)
        if best is None:
            return None
        usable, _, entry = best
        return CacheHit(entry.entry_id, ns, usable, len(entry.tokens))

    def find_exact(self, tokens: Sequence[int], ns: str = "") -> CacheHit | None:
        with self._lock:
            entry = self._entries.get(_entry_id(ns, tokens))
        if entry is None or entry.tokens != tuple(tokens):
            return None
        return CacheHit(entry.entry_id, ns, len(entry.tokens), len(entry.tokens))

    # -- restore ---------------------------------------------------------------------------
    def restore(self, hit: CacheHit) -> RestoredState | None:
        """Caches covering `hit.num_tokens`, or None (logged; a bad file is quarantined)."""
        with self._lock:
            entry = self._entries.get(hit.entry_id)
        loaded = self._read(entry) if entry is not None else None
        if entry is None or loaded is None:
            return None
        header, caches, attachments = loaded
        problem = self._identity_problem(header, hit.ns, entry.tokens)
        if problem is not None:
            log.warning("KV file %s not restored: %s", entry.path.name, problem)
            return None
        for cache in caches:
            excess = cache.offset - hit.num_tokens
            if excess > 0:
                cache.trim(excess)
        mx.eval([c.state for c in caches])
        self._touch(entry)
        return RestoredState(caches, entry.tokens[: hit.num_tokens], attachments, header.generation_checkpoint)

    def restore_async(self, hit: CacheHit) -> Future[RestoredState | None]:
        """`restore` on the store's I/O thread (prefetch while the request waits in line)."""
        return self._io.submit(self.restore, hit)

    # -- store -----------------------------------------------------------------------------
    def store(
        self,
        tokens: Sequence[int],
        caches: Sequence[LayerCache],
        ns: str = "",
        attachments: Attachments | None = None,
        checkpoint: GenerationCheckpoint | None = None,
    ) -> bool:
        """Persist caches covering `tokens`; False on any failure (nothing partial is visible)."""
        if not tokens:
            return False
        entry_id = _entry_id(ns, tokens)
        directory = self._root / _ns_key(ns)
        path = directory / f"{entry_id}{SUFFIX}"
        try:
            _make_private_dir(directory)
            header = write_file_atomically(path, build_header(self.identity, tokens, ns, checkpoint), caches, attachments, self._policy)
            size = path.stat().st_size
        except (OSError, StateError, ValueError) as e:
            log.warning("KV state of %d tokens not stored: %s", len(tokens), e)
            return False
        entry = _Entry(entry_id, path, ns, tuple(tokens), size, header.minimum_reusable_offset, header.trimmable, time.time())
        if size > self.max_bytes:
            path.unlink(missing_ok=True)
            log.warning("KV state of %d bytes exceeds the %d-byte cap; not stored", size, self.max_bytes)
            return False
        with self._lock:
            self._entries[entry_id] = entry
            self._supersede(entry)
            self._evict_over_cap(keep=entry_id)
        return True

    def store_object(self, key: str, tensors: dict[str, mx.array], ns: str = "") -> bool:
        """Persist exact tensors under `key` (no token prefix, e.g. an encoder's output)."""
        if not key:
            raise ValueError("object key must not be empty")
        entry_id = _object_id(ns, key)
        path = self._root / _ns_key(ns) / f"{entry_id}{SUFFIX}"
        try:
            _make_private_dir(path.parent)
            write_file_atomically(path, build_header(self.identity, (), ns, None), [],
                                  Attachments({OBJECT_ATTACHMENT: (key, tensors)}), self._policy)
            size = path.stat().st_size
        except (OSError, StateError, ValueError) as e:
            log.warning("object %r not stored: %s", key, e)
            return False
        with self._lock:
            self._entries[entry_id] = _Entry(entry_id, path, ns, (), size, 0, False, time.time())
            self._evict_over_cap(keep=entry_id)
        return True

    def restore_object(self, key: str, ns: str = "") -> dict[str, mx.array] | None:
        with self._lock:
            entry = self._entries.get(_object_id(ns, key))
        loaded = self._read(entry) if entry is not None else None
        if entry is None or loaded is None:
            return None
        header, _, attachments = loaded
        group = attachments.groups.get(OBJECT_ATTACHMENT)
        if self._identity_problem(header, ns, ()) is not None or group is None or group[0] != key:
            return None
        self._touch(entry)
        return group[1]

    def restore_object_async(self, key: str, ns: str = "") -> Future[dict[str, mx.array] | None]:
        return self._io.submit(self.restore_object, key, ns)

    # -- generation checkpoints ---------------------------------------------------------------
    def save_checkpoint(self, tokens: Sequence[int], caches: Sequence[LayerCache], checkpoint: GenerationCheckpoint) -> bool:
        """Write the newest checkpoint of `checkpoint.key`, atomically replacing the previous one
        (which stays in place until the new one is durable). False on any failure."""
        path = self._checkpoint_path(checkpoint.key)
        try:
            _make_private_dir(path.parent)
            header = build_header(self.identity, tokens, checkpoint.cache_ns, checkpoint)
            write_file_atomically(path, header, caches, None, self._policy)
        except (OSError, StateError, ValueError) as e:
            log.warning("checkpoint %s not written: %s", checkpoint.key[:12], e)
            return False
        return True

    def load_checkpoint(self, key: str) -> RestoredState | None:
        """The newest durable checkpoint of `key`, or None (a bad file is quarantined)."""
        path = self._checkpoint_path(key)
        loaded = self._read(path) if path.is_file() else None
        if loaded is None:
            return None
        header, caches, attachments = loaded
        checkpoint = header.generation_checkpoint
        if checkpoint is None or checkpoint.key != key or self._identity_problem(header, checkpoint.cache_ns, header.tokens):
            log.warning("checkpoint file %s does not belong to this identity or key; ignored", path.name)
            return None
        mx.eval([c.state for c in caches])
        return RestoredState(caches, header.tokens, attachments, checkpoint)

    def remove_checkpoint(self, key: str) -> None:
        self._checkpoint_path(key).unlink(missing_ok=True)

    def _checkpoint_path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"checkpoint key {key!r} must be a hex digest")
        return self._root / CHECKPOINT_DIR / f"{key}{SUFFIX}"

    def remove(self, hit: CacheHit) -> None:
        with self._lock:
            entry = self._entries.pop(hit.entry_id, None)
        if entry is not None:
            entry.path.unlink(missing_ok=True)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(len(self._entries), sum(e.size for e in self._entries.values()), self.max_bytes,
                              self._quarantined, self._evictions)

    def close(self) -> None:
        self._io.shutdown(wait=True)

    # -- helpers ---------------------------------------------------------------------------
    def _read(self, source: _Entry | Path) -> tuple[KvFileHeader, list[LayerCache], Attachments] | None:
        """A whole file, or None: gone (forgotten) or unreadable (logged and quarantined)."""
        path = source.path if isinstance(source, _Entry) else source
        try:
            return read_file(path)
        except FileNotFoundError:
            if isinstance(source, _Entry):
                self._forget(source.entry_id)
            return None
        except (StateError, OSError, ValueError) as e:
            log.warning("KV file %s is unreadable (%s); quarantined", path.name, e)
            self._quarantine(source)
            return None

    def _supersede(self, new: _Entry) -> None:
        """Drop shorter ancestors the new entry can serve (it must be trimmable down to them)."""
        for entry in list(self._entries.values()):
            if entry.ns == new.ns and supersedes(new.tokens, new.trimmable, new.minimum_reusable_offset, entry.tokens):
                self._delete(entry)

    def _evict_over_cap(self, keep: str) -> None:
        total = sum(e.size for e in self._entries.values())
        for entry in sorted(self._entries.values(), key=lambda e: e.last_used):
            if total <= self.max_bytes:
                break
            if entry.entry_id != keep:
                total -= entry.size
                self._delete(entry)
                self._evictions += 1

    def _delete(self, entry: _Entry) -> None:
        self._entries.pop(entry.entry_id, None)
        entry.path.unlink(missing_ok=True)

    def _forget(self, entry_id: str) -> None:
        with self._lock:
            self._entries.pop(entry_id, None)

    def _touch(self, entry: _Entry) -> None:
        now = time.time()
        with self._lock:
            entry.last_used = now
        try:
            os.utime(entry.path, (now, now))  # LRU order survives restarts through mtime
        except OSError:
            pass

    def _quarantine(self, entry: _Entry | Path) -> None:
        path = entry.path if isinstance(entry, _Entry) else entry
        if isinstance(entry, _Entry):
            self._forget(entry.entry_id)
        target = self._root / "quarantine"
        try:
            _make_private_dir(target)
            os.replace(path, target / path.name)
        except OSError as e:
            log.warning("could not quarantine %s: %s", path, e)
        with self._lock:
            self._quarantined += 1

    def _identity_problem(self, header: KvFileHeader, ns: str, tokens: Sequence[int]) -> str | None:
        wanted = self.identity
        for field, have, want in (
            ("model id", header.model_id, wanted.model_id),
            ("tokenizer hash", header.tokenizer_hash, wanted.tokenizer_hash),
            ("config fingerprint", header.config_fingerprint, wanted.config_fingerprint),
            ("namespace", header.ns, ns),
        ):
            if have != want:
                return f"{field} {have!r} is not {want!r}"
        if header.tokens != tuple(tokens):
            return "tokens differ from the index"
        return None

    def _scan(self) -> None:
        """Index this identity's files from their headers; reap orphans, quarantine bad files."""
        now = time.time()
        for directory in [d for d in self._root.iterdir() if d.is_dir() and d.name != "quarantine"]:
            for path in directory.iterdir():
                if path.name.endswith(".tmp"):
                    if now - path.stat().st_mtime > TMP_GRACE_S:
                        path.unlink(missing_ok=True)
                elif path.suffix == SUFFIX and directory.name != CHECKPOINT_DIR:
                    self._index_file(path)
        self._evict_over_cap(keep="")

    def _index_file(self, path: Path) -> None:
        try:
            header, complete = read_header(path)
        except (StateError, OSError, ValueError) as e:
            log.warning("KV file %s has a bad header (%s); quarantined", path.name, e)
            self._quarantine(path)
            return
        if not complete:
            log.warning("KV file %s is truncated; quarantined", path.name)
            self._quarantine(path)
            return
        if self._identity_problem(header, header.ns, header.tokens) is not None or path.stem != _expected_id(header):
            return  # another identity's or a renamed file: not ours to use or delete
        stat = path.stat()
        self._entries[path.stem] = _Entry(path.stem, path, header.ns, header.tokens, stat.st_size,
                                          header.minimum_reusable_offset, header.trimmable, stat.st_mtime)


def _entry_id(ns: str, tokens: Sequence[int]) -> str:
    digest = hashlib.sha256(ns.encode() + b"\0" + b",".join(str(t).encode() for t in tokens))
    return digest.hexdigest()[:32]


def _object_id(ns: str, key: str) -> str:
    return "obj-" + hashlib.sha256(ns.encode() + b"\0" + key.encode()).hexdigest()[:28]


def _expected_id(header: KvFileHeader) -> str:
    objects = [a for a in header.attachments if a.name == OBJECT_ATTACHMENT]
    if not header.tokens and len(objects) == 1:
        return _object_id(header.ns, objects[0].schema)
    return _entry_id(header.ns, header.tokens)


def _ns_key(ns: str) -> str:
    return "base" if ns == "" else "ns-" + hashlib.sha256(ns.encode()).hexdigest()[:16]


def _make_private_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)
