"""The remote tier under the SSD tier: `ColdTier` and `CheckpointStore` over an `SsdColdTier` and a
shared `RemoteStore` (Redis/Valkey or S3), so replicas reuse each other's KV.

    find:     the SSD index and the mirror of the remote index (memory only); the remote wins
              only with a strictly longer usable prefix
    restore:  a remote hit is read on this tier's threads under a deadline that grows with the
              prefix (past it the request prefills locally; the read goes on and lands on the SSD
              for the next one); the bytes go through the SSD store's checks (header, identity,
              name recomputed from the tokens) and its reader (every slot's checksum)
    store:    the SSD file, then the same bytes to the remote store (on the write-behind thread)
    checkpoints: the same, per request key; a replica without the checkpoint asks the remote
    failure:  any remote fault is a miss or a write left out, counted; the breaker stops asking a
              dead backend, and `health` says "degraded" until it answers again
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.prefix_index import Indexed, PrefixIndex
from mlxkv_inference.speculative.proposers import DraftState
from mlxkv_inference.prompt_cache import ColdHit, ColdRestored
from mlxkv_remote_cache import EntryInfo, IndexMirror, RemoteCacheError, RemoteConfig, RemoteStore, open_backend
from mlxkv_ssd_cache import KvIdentity, SsdCacheStore, StoreStats, read_header
from mlxkv_ssd_cache.layout import entry_id, identity_key, ns_key
from mlxkv_state.header import GenerationCheckpoint

from mlxkv.engine.cache_services import SsdColdTier
from mlxkv.engine.checkpoints import RestoredCheckpoint

log = logging.getLogger(__name__)

REMOTE = "remote:"  # a handle from the remote index (an SSD handle is a bare entry id)
RESTORE_BASE_S = 0.5
RESTORE_S_PER_TOKEN = 2e-3  # under half of what prefilling a token costs here (~5 ms at 1k tokens)


class RemoteStatus(Protocol):
    """What the engine reports of a remote tier: its health and its counts."""

    def health(self) -> str: ...

    def remote_stats(self) -> Mapping[str, int | float]: ...

    def take_write_failures(self) -> int:
        """Remote writes that failed since the previous call (a flush reports them)."""
        ...


def restore_deadline_s(num_tokens: int) -> float:
    return RESTORE_BASE_S + num_tokens * RESTORE_S_PER_TOKEN


class RemoteColdTier:
    def __init__(self, local: SsdColdTier, remote: RemoteStore, *, poll_s: float = 5.0,
                 deadline_s: Callable[[int], float] = restore_deadline_s) -> None:
        self.local = local
        self.remote = remote
        self._deadline_s = deadline_s
        self._lock = threading.Lock()
        self._index: PrefixIndex[str, EntryInfo] = PrefixIndex()
        self._counts = dict.fromkeys(("hits", "misses", "deadline_misses", "bad_objects", "writes", "writes_failed",
                                      "checkpoint_hits"), 0)
        self._unreported_failures = 0
        self._io = ThreadPoolExecutor(2, thread_name_prefix="mlxkv-remote-restore")
        self.mirror = IndexMirror(remote, self, poll_s=poll_s).start()

    @property
    def ssd(self) -> SsdCacheStore:
        return self.local.ssd

    # -- the index mirror's listener -------------------------------------------------------------
    def reset(self, entries: list[EntryInfo]) -> None:
        index: PrefixIndex[str, EntryInfo] = PrefixIndex()
        for entry in entries:
            if _valid(entry):
                index.add(_indexed(entry))
        with self._lock:
            self._index = index

    def put(self, entry: EntryInfo) -> None:
        if _valid(entry):
            with self._lock:
                self._index.add(_indexed(entry))

    def remove(self, ns_key: str, entry_id: str) -> None:
        with self._lock:
            self._index.remove(entry_id)

    # -- ColdTier ----------------------------------------------------------------------------------
    def find(self, prompt: Sequence[int], ns: str) -> ColdHit | None:
        local = self.local.find(prompt, ns)
        with self._lock:
            found = self._index.longest(prompt, ns)
        if found is None or (local is not None and local.num_tokens >= found[1]):
            return local
        item, usable = found
        return ColdHit(REMOTE + item.key, ns, usable, len(item.tokens))

    def find_exact(self, tokens: Sequence[int], ns: str) -> ColdHit | None:
        local = self.local.find_exact(tokens, ns)
        if local is not None:
            return local
        with self._lock:
            item = self._index.get(entry_id(ns, tokens))
        if item is None or item.tokens != tuple(tokens) or item.ns != ns:
            return None
        return ColdHit(REMOTE + item.key, ns, len(tokens), len(tokens))

    def restore(self, hit: ColdHit) -> ColdRestored | None:
        """A remote hit is never read here (this runs on the engine's thread): it restores only
        once a read ahead has put it on the SSD."""
        return self.local.restore(_local(hit))

    def restore_async(self, hit: ColdHit) -> Future[ColdRestored | None]:
        if not hit.handle.startswith(REMOTE):
            return self.local.restore_async(hit)
        return self._with_deadline(lambda: self._fetch(hit), self._deadline_s(hit.num_tokens))

    def store(self, tokens: Sequence[int], caches: Sequence[LayerCache], ns: str) -> bool:
        if not self.local.store(tokens, caches, ns):
            return False
        with self._lock:
            shared = self._index.get(entry_id(ns, tokens)) is not None
        if not shared:
            self._upload(ns, tokens)
        return True

    # -- CheckpointStore ------------------------------------------------------------------------
    def save_checkpoint(self, tokens: Sequence[int], caches: Sequence[LayerCache], checkpoint: GenerationCheckpoint,
                        draft: DraftState | None = None) -> bool:
        """The SSD checkpoint, then its bytes to the remote store (the draft's part stays local:
        a replica resuming without it lets the draft read the history again)."""
        if not self.local.save_checkpoint(tokens, caches, checkpoint, draft):
            return False
        try:
            data = self.local.ssd.checkpoint_file(checkpoint.key).read_bytes()
            self.remote.save_checkpoint(checkpoint.key, checkpoint.cache_ns, tokens, data)
        except (OSError, RemoteCacheError, ValueError) as e:
            self._write_failed()
            log.info("checkpoint %s not shared: %s", checkpoint.key[:12], e)
        return True

    def load_checkpoint(self, key: str) -> RestoredCheckpoint | None:
        restored = self.local.load_checkpoint(key)
        if restored is not None:
            return restored
        try:
            data = self.remote.load_checkpoint(key)
        except RemoteCacheError as e:
            log.info("checkpoint %s not asked of the remote tier: %s", key[:12], e)
            return None
        if data is None or not self.local.ssd.adopt_checkpoint(data, key):
            return None
        restored = self.local.load_checkpoint(key)
        self._count("checkpoint_hits" if restored is not None else "bad_objects")
        return restored

    def remove_checkpoint(self, key: str) -> None:
        self.local.remove_checkpoint(key)
        try:
            self.remote.remove_checkpoint(key)
        except RemoteCacheError as e:
            log.info("remote checkpoint %s not removed: %s", key[:12], e)

    def stats(self) -> StoreStats:
        return self.local.stats()

    # -- RemoteStatus ---------------------------------------------------------------------------
    def health(self) -> str:
        return "ok" if self.remote.healthy() else "degraded"

    def remote_stats(self) -> Mapping[str, int | float]:
        store = self.remote.stats()
        with self._lock:
            out: dict[str, int | float] = {f"remote_{name}": n for name, n in self._counts.items()}
            out["remote_index_entries"] = len(self._index)
        out["remote_bad_objects"] += store.bad_objects
        out.update(remote_get_bytes=store.get_bytes, remote_get_seconds=store.get_seconds, remote_gets=store.gets,
                   remote_put_bytes=store.put_bytes, remote_failures=store.failures, remote_skipped=store.skipped,
                   remote_breaker_open=int(not self.remote.healthy()), remote_breaker_opened=store.breaker_opened,
                   remote_expired=store.expired)
        return out

    def take_write_failures(self) -> int:
        with self._lock:
            failed, self._unreported_failures = self._unreported_failures, 0
        return failed

    def close(self) -> None:
        self.mirror.close()
        self._io.shutdown(wait=False, cancel_futures=True)

    # -- internals ---------------------------------------------------------------------------------
    def _fetch(self, hit: ColdHit) -> ColdRestored | None:
        """Read a remote entry, put it on the SSD, restore it from there (every check on the way)."""
        with self._lock:
            item = self._index.get(hit.handle.removeprefix(REMOTE))
        if item is None:
            self._count("misses")
            return None
        try:
            data = self.remote.get_entry(item.value)
        except RemoteCacheError as e:
            log.info("remote entry not read: %s", e)
            self._count("misses")
            return None
        adopted = self.local.ssd.adopt(data, hit.ns, item.tokens) if data is not None else None
        restored = self.local.restore(_local(hit)) if adopted is not None else None
        if restored is None:
            self._forget(item, bad=data is not None)
            self._count("misses")
            return None
        self._count("hits")
        return restored

    def _forget(self, item: Indexed[str, EntryInfo], *, bad: bool) -> None:
        """A remote entry that failed: out of this replica's index; deleted if this replica wrote it."""
        with self._lock:
            self._index.remove(item.key)
        if bad:
            self._count("bad_objects")
            try:
                self.remote.remove_entry(item.value)
            except RemoteCacheError:
                pass

    def _upload(self, ns: str, tokens: Sequence[int]) -> None:
        path = self.local.ssd.file_of(ns, tokens)
        try:
            data = path.read_bytes()
            header, _ = read_header(path)
            self.remote.put_entry(ns_key(ns), entry_id(ns, tokens), ns, tokens, data, header.minimum_reusable_offset,
                                  header.trimmable)
            self._count("writes")
        except (OSError, RemoteCacheError, ValueError) as e:  # the local copy stands; the others prefill
            self._write_failed()
            log.info("prompt state of %d tokens not shared: %s", len(tokens), e)

    def _with_deadline(self, work: Callable[[], ColdRestored | None], seconds: float) -> Future[ColdRestored | None]:
        outer: Future[ColdRestored | None] = Future()

        def settle(result: ColdRestored | None) -> bool:
            try:
                outer.set_result(result)
                return True
            except InvalidStateError:
                return False

        def late() -> None:
            if settle(None):
                self._count("deadline_misses")

        timer = threading.Timer(seconds, late)
        timer.daemon = True
        timer.start()

        def done(inner: Future[ColdRestored | None]) -> None:
            timer.cancel()
            settle(inner.result() if inner.exception() is None else None)

        self._io.submit(work).add_done_callback(done)
        return outer

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _write_failed(self) -> None:
        with self._lock:
            self._counts["writes_failed"] += 1
            self._unreported_failures += 1


def _local(hit: ColdHit) -> ColdHit:
    return ColdHit(hit.handle.removeprefix(REMOTE), hit.ns, hit.num_tokens, hit.entry_tokens)


def _valid(entry: EntryInfo) -> bool:
    """Whether a record's name is its content's (namespace and tokens): anything else is foreign."""
    m = entry.manifest
    return m.kind == "prompt" and bool(m.tokens) and m.name == entry_id(m.ns, m.tokens) and entry.ns_key == ns_key(m.ns)


def _indexed(entry: EntryInfo) -> Indexed[str, EntryInfo]:
    m = entry.manifest
    return Indexed(m.name, m.ns, m.tokens, m.size, m.minimum_reusable_offset, m.trimmable, entry)


def remote_store_opener(url: str, hmac_key_file: Path | None = None) -> Callable[[KvIdentity], RemoteStore]:
    """Opens the shared store at `url` (no connection yet: a bad URL is a `ValueError` now, a dead
    store a cold cache later) for the identity `build_tiers` gives it."""
    try:
        key = hmac_key_file.read_bytes().strip() if hmac_key_file is not None else None
    except OSError as e:
        raise ValueError(f"the HMAC key file cannot be read: {e}") from e
    config = RemoteConfig(hmac_key=key)
    backend = open_backend(url)
    return lambda identity: RemoteStore(backend, identity_key(identity), config)
