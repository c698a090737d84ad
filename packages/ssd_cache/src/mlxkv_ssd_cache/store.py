"""`SsdCacheStore`: prompt KV states on disk, indexed in memory, under a byte cap.

The file layout is in layout.py: a file's path carries its whole identity. One store serves one
model identity. Start-up reads headers only; `find` never touches the disk; `restore` returns None
on any fault and `store` returns False, so a bad disk is a cache miss.

    cap        prompt entries, objects and generation checkpoints together, least recently used
               out first (the rules of `PrefixIndex`); the effective cap is
               min(max_bytes, bytes held + free space of the filesystem - reserve_bytes), and a
               write that still finds the disk full evicts older entries and tries again
    checkpoints  expire `checkpoint_ttl_s` after their last write
    locking    the index lock covers the index only: files are written, read and deleted outside it
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.prefix_index import Indexed, PrefixIndex
from mlxkv_state.errors import StateError
from mlxkv_state.header import GenerationCheckpoint, KvFileHeader
from mlxkv_ssd_cache.kv_file import (
    Attachments, KvIdentity, build_header, expected_file_bytes, identity_problem, read_file, read_header,
    write_file_atomically,
)
from mlxkv_ssd_cache.layout import (
    CHECKPOINT_DIR, CHECKPOINT_KEY_PREFIX, OBJECT_ATTACHMENT, QUARANTINE_DIR, SUFFIX, entry_id, expected_id, free_bytes,
    identity_key, make_private_dir, ns_key, object_id,
)
from mlxkv_ssd_cache.scan import StoredFile, scan_identity_dir
from mlxkv_ssd_cache.slot_codec import SlotPolicy

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINT_TTL_S = 24 * 3600.0
DEFAULT_RESERVE_BYTES = 64 << 20  # left free on the filesystem for everything else

FreeSpaceProbe = Callable[[Path], int]


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
    entries: int  # prompt states and objects
    bytes: int  # everything held, checkpoints included
    max_bytes: int
    quarantined: int
    evictions: int
    checkpoints: int
    expired_checkpoints: int


_Index = PrefixIndex[str, StoredFile]
_Item = Indexed[str, StoredFile]


class SsdCacheStore:
    def __init__(
        self,
        directory: Path,
        identity: KvIdentity,
        max_bytes: int,
        policy: SlotPolicy = SlotPolicy(),
        *,
        checkpoint_ttl_s: float = DEFAULT_CHECKPOINT_TTL_S,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
        free_space: FreeSpaceProbe = free_bytes,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`checkpoint_ttl_s`: a checkpoint not rewritten for this long is deleted; `reserve_bytes`:
        space left free on the filesystem; `free_space` and `clock` measure the disk and the time
        (replaceable to simulate a small disk or a day passing)."""
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes} must be >= 1")
        if checkpoint_ttl_s <= 0:
            raise ValueError(f"checkpoint_ttl_s={checkpoint_ttl_s} must be > 0 seconds")
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes={reserve_bytes} must be >= 0")
        self.identity = identity
        self.max_bytes = max_bytes
        self.checkpoint_ttl_s = checkpoint_ttl_s
        self._reserve = reserve_bytes
        self._free_space = free_space
        self._clock = clock
        self._policy = policy
        self.root = Path(directory).expanduser() / identity_key(identity)
        self._lock = threading.Lock()
        self._index: _Index = PrefixIndex()
        self._quarantined = 0
        self._evictions = 0
        self._expired = 0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="mlxkv-ssd-restore")
        make_private_dir(self.root)
        self._scan()

    # -- lookup (index only) ---------------------------------------------------------------
    def find(self, prompt: Sequence[int], ns: str = "") -> CacheHit | None:
        """The longest usable stored prefix of `prompt` (at most len(prompt) - 1 tokens)."""
        with self._lock:
            found = self._index.longest(prompt, ns)
        if found is None:
            return None
        item, usable = found
        return CacheHit(item.key, ns, usable, len(item.tokens))

    def find_exact(self, tokens: Sequence[int], ns: str = "") -> CacheHit | None:
        with self._lock:
            item = self._index.get(entry_id(ns, tokens))
        if item is None or item.tokens != tuple(tokens) or item.ns != ns:
            return None
        return CacheHit(item.key, ns, len(item.tokens), len(item.tokens))

    # -- restore ---------------------------------------------------------------------------
    def restore(self, hit: CacheHit) -> RestoredState | None:
        """Caches covering `hit.num_tokens`, or None (logged; a bad file is quarantined)."""
        with self._lock:
            item = self._index.get(hit.entry_id)
        loaded = self._read(item) if item is not None else None
        if item is None or loaded is None:
            return None
        header, caches, attachments = loaded
        if self._refused(item, header, hit.ns, item.tokens):
            return None
        for cache in caches:
            excess = cache.offset - hit.num_tokens
            if excess > 0:
                cache.trim(excess)
        mx.eval([c.state for c in caches])
        self._touch(item)
        return RestoredState(caches, item.tokens[: hit.num_tokens], attachments, header.generation_checkpoint)

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
        key = entry_id(ns, tokens)
        path = self.root / ns_key(ns) / f"{key}{SUFFIX}"
        header = build_header(self.identity, tokens, ns, checkpoint)
        written = self._write(key, path, header, caches, attachments, f"KV state of {len(tokens)} tokens")
        if written is None:
            return False
        header, size = written
        self._admit(Indexed(key, ns, tuple(tokens), size, header.minimum_reusable_offset, header.trimmable,
                            StoredFile(path, "prompt", self._clock())))
        return True

    def store_object(self, key: str, tensors: dict[str, mx.array], ns: str = "") -> bool:
        """Persist exact tensors under `key` (no token prefix, e.g. an encoder's output)."""
        if not key:
            raise ValueError("object key must not be empty")
        item_key = object_id(ns, key)
        path = self.root / ns_key(ns) / f"{item_key}{SUFFIX}"
        attachments = Attachments({OBJECT_ATTACHMENT: (key, tensors)})
        written = self._write(item_key, path, build_header(self.identity, (), ns, None), [], attachments, f"object {key!r}")
        if written is None:
            return False
        self._admit(Indexed(item_key, ns, (), written[1], 0, False, StoredFile(path, "object", self._clock())))
        return True

    def restore_object(self, key: str, ns: str = "") -> dict[str, mx.array] | None:
        with self._lock:
            item = self._index.get(object_id(ns, key))
        loaded = self._read(item) if item is not None else None
        if item is None or loaded is None:
            return None
        header, _, attachments = loaded
        group = attachments.groups.get(OBJECT_ATTACHMENT)
        if self._refused(item, header, ns, ()) or group is None or group[0] != key:
            return None
        self._touch(item)
        return group[1]

    def restore_object_async(self, key: str, ns: str = "") -> Future[dict[str, mx.array] | None]:
        return self._io.submit(self.restore_object, key, ns)

    # -- files from elsewhere (another replica's, through a shared tier) -------------------------
    def file_of(self, ns: str, tokens: Sequence[int]) -> Path:
        """Where the prompt state of `tokens` is (or would be) stored."""
        return self.root / ns_key(ns) / f"{entry_id(ns, tokens)}{SUFFIX}"

    def checkpoint_file(self, key: str) -> Path:
        return self._checkpoint_path(key)

    def adopt(self, data: bytes, ns: str, tokens: Sequence[int]) -> CacheHit | None:
        """Take the bytes of a prompt state's file written elsewhere: its header must name this
        identity, `ns` and exactly `tokens` (so its name, recomputed from them, is the entry's),
        and list no slot past its end; its slots are checked when it is restored. None if refused."""
        tokens = tuple(tokens)
        if not tokens or len(data) > self.max_bytes or not self._make_room(len(data), keep=entry_id(ns, tokens)):
            return None
        path = self.file_of(ns, tokens)
        header = self._place(data, path, lambda h: identity_problem(self.identity, h, ns, tokens)
                             or (None if expected_id(h) == path.stem else "its name is not its content's"))
        if header is None:
            return None
        key = entry_id(ns, tokens)
        self._admit(Indexed(key, ns, tokens, len(data), header.minimum_reusable_offset, header.trimmable,
                            StoredFile(self.file_of(ns, tokens), "prompt", self._clock())))
        return CacheHit(key, ns, len(tokens), len(tokens))

    def adopt_checkpoint(self, data: bytes, key: str) -> bool:
        """Put a checkpoint file written elsewhere in place (unless one of `key` is here); its
        header must be this identity's checkpoint of `key`. `load_checkpoint` then reads it."""
        path = self._checkpoint_path(key)
        if path.exists() or len(data) > self.max_bytes or not self._make_room(len(data), keep=CHECKPOINT_KEY_PREFIX + key):
            return False
        def problem(header: KvFileHeader) -> str | None:
            ckpt = header.generation_checkpoint
            if ckpt is None or ckpt.key != key:
                return "not this request's checkpoint"
            return identity_problem(self.identity, header, ckpt.cache_ns, header.tokens)
        return self._place(data, path, problem) is not None

    def _place(self, data: bytes, path: Path, problem_of: Callable[[KvFileHeader], str | None]) -> KvFileHeader | None:
        """Write `data` beside `path`, check its header, rename it into place; None (nothing left) if refused."""
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            make_private_dir(path.parent)
            with open(tmp, "xb") as out:
                out.write(data)
            header, complete = read_header(tmp)
            problem = problem_of(header) if complete else "slots past the end of the file"
            if problem is not None:
                log.warning("a KV file from elsewhere was refused: %s", problem)
                tmp.unlink(missing_ok=True)
                return None
            os.replace(tmp, path)
            return header
        except (StateError, OSError, ValueError) as e:
            log.warning("a KV file from elsewhere was refused: %s", e)
            tmp.unlink(missing_ok=True)
            return None

    # -- generation checkpoints ---------------------------------------------------------------
    def save_checkpoint(self, tokens: Sequence[int], caches: Sequence[LayerCache], checkpoint: GenerationCheckpoint) -> bool:
        """Write the newest checkpoint of `checkpoint.key`, atomically replacing the previous one
        (which stays in place until the new one is durable). False on any failure."""
        path = self._checkpoint_path(checkpoint.key)
        key = CHECKPOINT_KEY_PREFIX + checkpoint.key
        header = build_header(self.identity, tokens, checkpoint.cache_ns, checkpoint)
        written = self._write(key, path, header, caches, None, f"checkpoint {checkpoint.key[:12]}")
        if written is None:
            return False
        self._admit(Indexed(key, checkpoint.cache_ns, (), written[1], 0, False, StoredFile(path, "checkpoint", self._clock())))
        return True

    def load_checkpoint(self, key: str) -> RestoredState | None:
        """The newest durable checkpoint of `key`, or None (a bad or expired file is removed)."""
        path = self._checkpoint_path(key)
        with self._lock:
            item = self._index.get(CHECKPOINT_KEY_PREFIX + key)
        item = item or self._adopt_checkpoint(key, path)
        if item is None:
            return None
        if self._clock() - item.value.written_at > self.checkpoint_ttl_s:
            self._expire([item])
            return None
        loaded = self._read(item)
        if loaded is None:
            return None
        header, caches, attachments = loaded
        checkpoint = header.generation_checkpoint
        if checkpoint is None or checkpoint.key != key:
            log.warning("checkpoint file %s holds another request's state; quarantined", path.name)
            self._quarantine(item)
            return None
        if self._refused(item, header, checkpoint.cache_ns, header.tokens):
            return None
        mx.eval([c.state for c in caches])
        return RestoredState(caches, header.tokens, attachments, checkpoint)

    def _adopt_checkpoint(self, key: str, path: Path) -> _Item | None:
        """Index a checkpoint file this store did not write (another process of this identity
        wrote it, or it was put back by hand); its mtime is its last write."""
        try:
            stat = path.stat()
        except OSError:
            return None
        item: _Item = Indexed(CHECKPOINT_KEY_PREFIX + key, "", (), stat.st_size, 0, False,
                              StoredFile(path, "checkpoint", stat.st_mtime))
        with self._lock:
            self._index.add(item)
        return item

    def remove_checkpoint(self, key: str) -> None:
        path = self._checkpoint_path(key)
        with self._lock:
            self._index.remove(CHECKPOINT_KEY_PREFIX + key)
        path.unlink(missing_ok=True)

    def remove(self, hit: CacheHit) -> None:
        with self._lock:
            item = self._index.remove(hit.entry_id)
        if item is not None:
            self._unlink([item])

    def stats(self) -> StoreStats:
        with self._lock:
            items = self._index.lru_order()
            checkpoints = sum(1 for i in items if i.value.kind == "checkpoint")
            return StoreStats(len(items) - checkpoints, self._index.nbytes, self.max_bytes, self._quarantined,
                              self._evictions, checkpoints, self._expired)

    def effective_max_bytes(self) -> int:
        """The cap in force now: `max_bytes`, or less when the filesystem cannot hold that much."""
        free = self._probe_free()
        with self._lock:
            return self._cap(free)

    def close(self) -> None:
        self._io.shutdown(wait=True)

    # -- writing and admission -----------------------------------------------------------------
    def _write(
        self, key: str, path: Path, header: KvFileHeader, caches: Sequence[LayerCache],
        attachments: Attachments | None, what: str,
    ) -> tuple[KvFileHeader, int] | None:
        """Write one file atomically, making room first; (header, size) or None (logged)."""
        needed = expected_file_bytes(caches)
        if needed > self.max_bytes:
            log.warning("%s of about %d bytes exceeds the %d-byte cap; not stored", what, needed, self.max_bytes)
            return None
        if not self._make_room(needed, keep=key):
            log.warning("%s of about %d bytes does not fit the disk's free space; not stored", what, needed)
            return None
        try:
            make_private_dir(path.parent)
            written = self._write_evicting_when_full(key, path, header, caches, attachments, needed)
            size = path.stat().st_size
        except (OSError, StateError, ValueError) as e:
            log.warning("%s not stored: %s", what, e)
            return None
        if size > self.max_bytes:
            path.unlink(missing_ok=True)
            log.warning("%s of %d bytes exceeds the %d-byte cap; not stored", what, size, self.max_bytes)
            return None
        return written, size

    def _write_evicting_when_full(
        self, key: str, path: Path, header: KvFileHeader, caches: Sequence[LayerCache],
        attachments: Attachments | None, needed: int,
    ) -> KvFileHeader:
        """`write_file_atomically`; on a full disk, evict least recently used entries (about
        `needed` bytes' worth at a time) and try again, until nothing is left to evict."""
        while True:
            try:
                return write_file_atomically(path, header, caches, attachments, self._policy)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                with self._lock:
                    evicted = self._index.evict_to(self._index.nbytes - max(needed, 1), keep=key)
                    self._evictions += len(evicted)
                if not evicted:
                    raise
                log.info("disk full: evicted %d entries to make room", len(evicted))
                self._unlink(evicted)

    def _make_room(self, needed: int, keep: str) -> bool:
        """Evict least recently used entries so that `needed` more bytes fit the effective cap;
        False (nothing evicted) when they would not fit even with every entry gone."""
        free = self._probe_free()
        with self._lock:
            cap = self._cap(free)
            if needed > cap:
                return False
            evicted = self._index.evict_to(cap - needed, keep=keep)
            self._evictions += len(evicted)
        self._unlink(evicted)
        return True

    def _admit(self, item: _Item) -> None:
        """Index a written file; supersede, expire and evict what it makes redundant or pushes out."""
        free = self._probe_free()
        now = self._clock()
        with self._lock:
            superseded = self._index.add(item)
            expired = self._expired_checkpoints(now)
            for old in expired:
                self._index.remove(old.key)
            self._expired += len(expired)
            evicted = self._index.evict_to(self._cap(free), keep=item.key)
            self._evictions += len(evicted)
        self._unlink(superseded + expired + evicted)

    def _cap(self, free: int) -> int:
        """The effective cap (call with the lock held): what we hold plus what the disk can take."""
        return max(0, min(self.max_bytes, self._index.nbytes + free - self._reserve))

    def _probe_free(self) -> int:
        try:
            return self._free_space(self.root)
        except OSError as e:
            log.warning("free space of %s unknown (%s); using the configured cap", self.root, e)
            return self.max_bytes + self._reserve

    def _expired_checkpoints(self, now: float) -> list[_Item]:
        return [i for i in self._index.lru_order()
                if i.value.kind == "checkpoint" and now - i.value.written_at > self.checkpoint_ttl_s]

    def _expire(self, items: list[_Item]) -> None:
        with self._lock:
            gone = [i for i in items if self._index.remove(i.key) is not None]
            self._expired += len(gone)
        self._unlink(gone)

    def _unlink(self, items: Sequence[_Item]) -> None:
        """Delete files dropped from the index (outside the lock), unless one was re-added meanwhile."""
        for item in items:
            with self._lock:
                current = self._index.get(item.key)
            if current is None or current.value.path != item.value.path:
                item.value.path.unlink(missing_ok=True)

    # -- reading -------------------------------------------------------------------------------
    def _read(self, item: _Item) -> tuple[KvFileHeader, list[LayerCache], Attachments] | None:
        """A whole file, or None: gone (forgotten) or unreadable (logged and quarantined)."""
        path = item.value.path
        try:
            return read_file(path)
        except FileNotFoundError:
            with self._lock:
                self._index.remove(item.key)
            return None
        except (StateError, OSError, ValueError) as e:
            log.warning("KV file %s is unreadable (%s); quarantined", path.name, e)
            self._quarantine(item)
            return None

    def _refused(self, item: _Item, header: KvFileHeader, ns: str, tokens: Sequence[int]) -> bool:
        """Whether a file read back fails the identity guard; such a file leaves the index and
        is quarantined, so it is never read again."""
        problem = identity_problem(self.identity, header, ns, tokens)
        if problem is None:
            return False
        log.warning("KV file %s not restored: %s; quarantined", item.value.path.name, problem)
        self._quarantine(item)
        return True

    def _touch(self, item: _Item) -> None:
        now = time.time()
        with self._lock:
            self._index.touch(item.key)
        try:
            os.utime(item.value.path, (now, now))  # LRU order survives restarts through mtime
        except OSError:
            pass

    def _quarantine(self, source: _Item | Path) -> None:
        if isinstance(source, Path):
            path = source
        else:
            path = source.value.path
            with self._lock:
                self._index.remove(source.key)
        target = self.root / QUARANTINE_DIR
        try:
            make_private_dir(target)
            os.replace(path, target / path.name)
        except OSError as e:
            log.warning("could not quarantine %s: %s", path, e)
        with self._lock:
            self._quarantined += 1

    def _checkpoint_path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"checkpoint key {key!r} must be a hex digest")
        return self.root / CHECKPOINT_DIR / f"{key}{SUFFIX}"

    # -- start-up --------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index this identity's files oldest first; drop expired checkpoints; enforce the cap."""
        now = self._clock()
        scanned = scan_identity_dir(self.root, self.identity)
        for path in scanned.bad:
            self._quarantine(path)
        expired = []
        for item in scanned.items:
            if item.value.kind == "checkpoint" and now - item.value.written_at > self.checkpoint_ttl_s:
                expired.append(item)
            else:
                self._unlink(self._index.add(item))
        self._expired += len(expired)
        self._unlink(expired)
        evicted = self._index.evict_to(self._cap(self._probe_free()))
        self._evictions += len(evicted)
        self._unlink(evicted)
