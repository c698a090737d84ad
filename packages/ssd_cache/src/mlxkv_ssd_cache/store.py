"""`SsdCacheStore`: prompt KV states on disk, indexed in memory, under a byte cap.

The file layout is in layout.py: a file's path carries its whole identity. One store serves one
model identity. Start-up reads headers only; `find` never touches the disk; `restore` returns None
on any fault and `store` returns False, so a bad disk is a cache miss.

    index      index.py: the in-memory index; its lock covers the index only, files are written,
               read and deleted outside it
    capacity   capacity.py: the byte cap, the free-space reserve, checkpoint expiry, what is evicted
    files      files.py: paths, atomic writes, files from elsewhere, quarantine
    reading    reading.py: files read back, forgotten or quarantined when they fail
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.prefix_index import Indexed
from mlxkv_state.errors import StateError
from mlxkv_state.header import GenerationCheckpoint, KvFileHeader
from mlxkv_ssd_cache.capacity import (
    DEFAULT_CHECKPOINT_TTL_S, DEFAULT_RESERVE_BYTES, Capacity, DiskBudget, FreeSpaceProbe,
)
from mlxkv_ssd_cache.files import StoreFiles
from mlxkv_ssd_cache.reading import GuardedReader
from mlxkv_ssd_cache.index import StoreIndex, StoreStats, is_expired
from mlxkv_ssd_cache.kv_file import (
    Attachments, KvIdentity, build_header, expected_file_bytes, identity_problem,
)
from mlxkv_ssd_cache.layout import (
    CHECKPOINT_KEY_PREFIX, OBJECT_ATTACHMENT, entry_id, expected_id, free_bytes, identity_key, object_id,
)
from mlxkv_ssd_cache.scan import StoredFile, scan_identity_dir
from mlxkv_ssd_cache.slot_codec import SlotPolicy

__all__ = ["DEFAULT_CHECKPOINT_TTL_S", "CacheHit", "RestoredState", "SsdCacheStore", "StoreStats"]

log = logging.getLogger(__name__)


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
        root = Path(directory).expanduser() / identity_key(identity)
        self._index = StoreIndex()
        self._capacity = Capacity(self._index, DiskBudget(root, max_bytes, reserve_bytes, free_space),
                                  checkpoint_ttl_s, clock)
        self.identity = identity
        self.max_bytes = max_bytes
        self.checkpoint_ttl_s = checkpoint_ttl_s
        self.root = root
        self._clock = clock
        self._files = StoreFiles(root, policy)
        self._reader = GuardedReader(self._index, self._files, identity)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="mlxkv-ssd-restore")
        self._scan()

    # -- lookup (index only) ---------------------------------------------------------------
    def find(self, prompt: Sequence[int], ns: str = "") -> CacheHit | None:
        """The longest usable stored prefix of `prompt` (at most len(prompt) - 1 tokens)."""
        found = self._index.longest(prompt, ns)
        if found is None:
            return None
        item, usable = found
        return CacheHit(item.key, ns, usable, len(item.tokens))

    def find_exact(self, tokens: Sequence[int], ns: str = "") -> CacheHit | None:
        item = self._index.get(entry_id(ns, tokens))
        if item is None or item.tokens != tuple(tokens) or item.ns != ns:
            return None
        return CacheHit(item.key, ns, len(item.tokens), len(item.tokens))

    # -- restore ---------------------------------------------------------------------------
    def restore(self, hit: CacheHit) -> RestoredState | None:
        """Caches covering `hit.num_tokens`, or None (logged; a bad file is quarantined)."""
        item = self._index.get(hit.entry_id)
        loaded = self._reader.read(item) if item is not None else None
        if item is None or loaded is None:
            return None
        header, caches, attachments = loaded
        if self._reader.refused(item, header, hit.ns, item.tokens):
            return None
        for cache in caches:
            excess = cache.offset - hit.num_tokens
            if excess > 0:
                cache.trim(excess)
        mx.eval([c.state for c in caches])
        self._reader.touch(item)
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
        path = self._files.prompt_path(ns, tokens)
        header = build_header(self.identity, tokens, ns, checkpoint)
        written = self._write(key, path, header, caches, attachments, f"KV state of {len(tokens)} tokens")
        if written is None:
            return False
        header, size = written
        self._capacity.admit(Indexed(key, ns, tuple(tokens), size, header.minimum_reusable_offset, header.trimmable,
                                     StoredFile(path, "prompt", self._clock())))
        return True

    def store_object(self, key: str, tensors: dict[str, mx.array], ns: str = "") -> bool:
        """Persist exact tensors under `key` (no token prefix, e.g. an encoder's output)."""
        if not key:
            raise ValueError("object key must not be empty")
        item_key = object_id(ns, key)
        path = self._files.object_path(ns, key)
        attachments = Attachments({OBJECT_ATTACHMENT: (key, tensors)})
        written = self._write(item_key, path, build_header(self.identity, (), ns, None), [], attachments, f"object {key!r}")
        if written is None:
            return False
        self._capacity.admit(Indexed(item_key, ns, (), written[1], 0, False, StoredFile(path, "object", self._clock())))
        return True

    def restore_object(self, key: str, ns: str = "") -> dict[str, mx.array] | None:
        item = self._index.get(object_id(ns, key))
        loaded = self._reader.read(item) if item is not None else None
        if item is None or loaded is None:
            return None
        header, _, attachments = loaded
        group = attachments.groups.get(OBJECT_ATTACHMENT)
        if self._reader.refused(item, header, ns, ()) or group is None or group[0] != key:
            return None
        self._reader.touch(item)
        return group[1]

    def restore_object_async(self, key: str, ns: str = "") -> Future[dict[str, mx.array] | None]:
        return self._io.submit(self.restore_object, key, ns)

    # -- files from elsewhere (another replica's, through a shared tier) -------------------------
    def file_of(self, ns: str, tokens: Sequence[int]) -> Path:
        """Where the prompt state of `tokens` is (or would be) stored."""
        return self._files.prompt_path(ns, tokens)

    def checkpoint_file(self, key: str) -> Path:
        return self._files.checkpoint_path(key)

    def adopt(self, data: bytes, ns: str, tokens: Sequence[int]) -> CacheHit | None:
        """Take the bytes of a prompt state's file written elsewhere: its header must name this
        identity, `ns` and exactly `tokens` (so its name, recomputed from them, is the entry's),
        and list no slot past its end; its slots are checked when it is restored. None if refused."""
        tokens = tuple(tokens)
        if not tokens or len(data) > self.max_bytes or not self._capacity.make_room(len(data), keep=entry_id(ns, tokens)):
            return None
        path = self.file_of(ns, tokens)
        header = self._files.place(data, path, lambda h: identity_problem(self.identity, h, ns, tokens)
                                   or (None if expected_id(h) == path.stem else "its name is not its content's"))
        if header is None:
            return None
        key = entry_id(ns, tokens)
        self._capacity.admit(Indexed(key, ns, tokens, len(data), header.minimum_reusable_offset, header.trimmable,
                                     StoredFile(path, "prompt", self._clock())))
        return CacheHit(key, ns, len(tokens), len(tokens))

    def adopt_checkpoint(self, data: bytes, key: str) -> bool:
        """Put a checkpoint file written elsewhere in place (unless one of `key` is here); its
        header must be this identity's checkpoint of `key`. `load_checkpoint` then reads it."""
        path = self._files.checkpoint_path(key)
        if path.exists() or len(data) > self.max_bytes or not self._capacity.make_room(len(data), keep=CHECKPOINT_KEY_PREFIX + key):
            return False
        def problem(header: KvFileHeader) -> str | None:
            ckpt = header.generation_checkpoint
            if ckpt is None or ckpt.key != key:
                return "not this request's checkpoint"
            return identity_problem(self.identity, header, ckpt.cache_ns, header.tokens)
        return self._files.place(data, path, problem) is not None

    # -- generation checkpoints ---------------------------------------------------------------
    def save_checkpoint(self, tokens: Sequence[int], caches: Sequence[LayerCache], checkpoint: GenerationCheckpoint) -> bool:
        """Write the newest checkpoint of `checkpoint.key`, atomically replacing the previous one
        (which stays in place until the new one is durable). False on any failure."""
        path = self._files.checkpoint_path(checkpoint.key)
        key = CHECKPOINT_KEY_PREFIX + checkpoint.key
        header = build_header(self.identity, tokens, checkpoint.cache_ns, checkpoint)
        written = self._write(key, path, header, caches, None, f"checkpoint {checkpoint.key[:12]}")
        if written is None:
            return False
        self._capacity.admit(Indexed(key, checkpoint.cache_ns, (), written[1], 0, False,
                                     StoredFile(path, "checkpoint", self._clock())))
        return True

    def load_checkpoint(self, key: str) -> RestoredState | None:
        """The newest durable checkpoint of `key`, or None (a bad or expired file is removed)."""
        item = self._reader.checkpoint(key)
        if item is None:
            return None
        if is_expired(item, self._clock(), self.checkpoint_ttl_s):
            self._capacity.expire([item])
            return None
        loaded = self._reader.read(item)
        if loaded is None:
            return None
        header, caches, attachments = loaded
        checkpoint = header.generation_checkpoint
        if checkpoint is None or checkpoint.key != key:
            log.warning("checkpoint file %s holds another request's state; quarantined", item.value.path.name)
            self._reader.quarantine(item)
            return None
        if self._reader.refused(item, header, checkpoint.cache_ns, header.tokens):
            return None
        mx.eval([c.state for c in caches])
        return RestoredState(caches, header.tokens, attachments, checkpoint)

    def remove_checkpoint(self, key: str) -> None:
        path = self._files.checkpoint_path(key)
        self._index.remove(CHECKPOINT_KEY_PREFIX + key)
        path.unlink(missing_ok=True)

    def remove(self, hit: CacheHit) -> None:
        item = self._index.remove(hit.entry_id)
        if item is not None:
            self._capacity.drop([item])

    def stats(self) -> StoreStats:
        return self._index.stats(self.max_bytes)

    def effective_max_bytes(self) -> int:
        """The cap in force now: `max_bytes`, or less when the filesystem cannot hold that much."""
        return self._capacity.effective_max_bytes()

    def close(self) -> None:
        self._io.shutdown(wait=True)

    # -- keeping the index and the files in step -------------------------------------------------
    def _write(
        self, key: str, path: Path, header: KvFileHeader, caches: Sequence[LayerCache],
        attachments: Attachments | None, what: str,
    ) -> tuple[KvFileHeader, int] | None:
        """Write one file atomically, making room first; (header, size) or None (logged)."""
        needed = expected_file_bytes(caches)
        if needed > self.max_bytes:
            log.warning("%s of about %d bytes exceeds the %d-byte cap; not stored", what, needed, self.max_bytes)
            return None
        if not self._capacity.make_room(needed, keep=key):
            log.warning("%s of about %d bytes does not fit the disk's free space; not stored", what, needed)
            return None
        try:
            written, size = self._files.write(path, header, caches, attachments,
                                              on_full=lambda: self._capacity.evict_for_full_disk(needed, keep=key))
        except (OSError, StateError, ValueError) as e:
            log.warning("%s not stored: %s", what, e)
            return None
        if size > self.max_bytes:
            path.unlink(missing_ok=True)
            log.warning("%s of %d bytes exceeds the %d-byte cap; not stored", what, size, self.max_bytes)
            return None
        return written, size

    def _scan(self) -> None:
        """Index this identity's files oldest first; drop expired checkpoints; enforce the cap."""
        scanned = scan_identity_dir(self.root, self.identity)
        for path in scanned.bad:
            self._reader.quarantine(path)
        self._capacity.load(scanned.items)
