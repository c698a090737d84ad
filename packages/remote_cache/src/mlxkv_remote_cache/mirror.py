"""`IndexMirror`: keeps a replica's view of the shared index current, off the request path.

    start:   (log position) -> listing of this identity's manifests -> listener.reset
    then:    a store with an index log (Redis stream): follow it, each "put"/"del" record applied as
             it comes; a full listing again every `relist_s` (catches evictions, which log nothing)
             a store without one (S3): a full listing every `poll_s`
    down:    the breaker turns calls away; the loop keeps probing at the breaker's pace and lists
             again once the backend answers (it may have lost everything meanwhile)

A record the mirror holds may be stale (the entry evicted since): reading it then is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from mlxkv_remote_cache.errors import RemoteUnavailableError
from mlxkv_remote_cache.keys import events_channel, identity_prefix
from mlxkv_remote_cache.store import EntryInfo, RemoteStore

log = logging.getLogger(__name__)


class MirrorListener(Protocol):
    def reset(self, entries: list[EntryInfo]) -> None: ...

    def put(self, entry: EntryInfo) -> None: ...

    def remove(self, ns_key: str, entry_id: str) -> None: ...


class IndexMirror:
    def __init__(self, store: RemoteStore, listener: MirrorListener, *, poll_s: float = 5.0, relist_s: float = 60.0,
                 block_ms: int = 500) -> None:
        self._store = store
        self._listener = listener
        self._poll_s = poll_s
        self._relist_s = relist_s
        self._block_ms = block_ms
        self.ready = threading.Event()  # set after the first complete listing
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxkv-remote-index", daemon=True)

    def start(self) -> IndexMirror:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        events = self._store.events
        channel = events_channel(self._store.identity_key)
        position: str | None = None
        listed_at = float("-inf")
        while not self._stop.is_set():
            try:
                if position is None or time.monotonic() - listed_at > (self._relist_s if events else self._poll_s):
                    if events is not None:  # the log's position first: nothing put during the listing is lost
                        position, _ = self._store.guarded(lambda: events.follow(channel, "$", 1))
                    self._listener.reset(self._store.list_entries())
                    listed_at = time.monotonic()
                    position = position or "-"
                    self.ready.set()
                if events is None:
                    self._stop.wait(self._poll_s)
                    continue
                after = position
                position, records = self._store.guarded(lambda: events.follow(channel, after, self._block_ms))
                for record in records:
                    self._apply(record)
            except RemoteUnavailableError as e:
                log.debug("remote index not followed: %s", e)
                position = None
                self._stop.wait(min(self._store.breaker.open_s, 1.0))
            except Exception:  # noqa: BLE001 - the mirror must outlive any one bad record
                log.warning("remote index mirror failed; listing again", exc_info=True)
                position = None
                self._stop.wait(1.0)

    def _apply(self, record: bytes) -> None:
        op, _, key = record.decode(errors="replace").partition(" ")
        rest = key.removeprefix(identity_prefix(self._store.identity_key)).split("/")
        if not key.startswith(identity_prefix(self._store.identity_key)) or len(rest) != 3:
            return
        if op == "put":
            entry = self._store.entry_at(key)
            if entry is not None:
                self._listener.put(entry)
        elif op == "del":
            self._listener.remove(rest[0], rest[1])
