"""Stored responses (`store: true`): a response's conversation items and the object `GET` returns,
so a continuation by `previous_response_id` sends only its new items.

On disk (beside the SSD prompt cache) they outlive a restart, and the prompt rebuilt from the
stored items tokenizes to the prefix the prompt cache holds: the continuation neither re-sends
nor re-prefills. Without a cache directory they live in memory. Both stores keep to a byte cap
(oldest first out) and a TTL; an unreadable or corrupt file is a miss.

    DIR/resp_<32 hex>.json    {"id", "model", "items": [...], "response": {...}}
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)
_ID = re.compile(r"resp_[0-9a-f]{32}")
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_TTL_S = 30 * 24 * 3600.0  # OpenAI keeps stored responses 30 days


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    model: str
    items: tuple[dict[str, Any], ...]  # the conversation: every input item so far, then this response's output
    response: dict[str, Any]  # the response object, as GET returns it

    def to_json(self) -> bytes:
        return json.dumps({"id": self.id, "model": self.model, "items": list(self.items), "response": self.response},
                          ensure_ascii=False, separators=(",", ":")).encode()


class ResponseStore(Protocol):
    def get(self, response_id: str) -> StoredResponse | None: ...

    def put(self, stored: StoredResponse) -> None: ...

    def delete(self, response_id: str) -> bool: ...


def valid_id(response_id: str) -> bool:
    return _ID.fullmatch(response_id) is not None


class MemoryResponseStore:
    """Stored responses in RAM (lost on restart): the store when the server has no cache directory."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, ttl_s: float = DEFAULT_TTL_S) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes} must be >= 1")
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._entries: OrderedDict[str, tuple[StoredResponse, int, float]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or time.time() - entry[2] > self.ttl_s:
                return None
            return entry[0]

    def put(self, stored: StoredResponse) -> None:
        size = len(stored.to_json())
        with self._lock:
            self._drop(stored.id)
            self._entries[stored.id] = (stored, size, time.time())
            self._bytes += size
            while self._bytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry[1]
        return entry is not None


class DiskResponseStore:
    """Stored responses as one JSON file each, written atomically (temp file, fsync, rename)."""

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_MAX_BYTES, ttl_s: float = DEFAULT_TTL_S) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes} must be >= 1")
        self.directory, self.max_bytes, self.ttl_s = directory, max_bytes, ttl_s
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def get(self, response_id: str) -> StoredResponse | None:
        if not valid_id(response_id):
            return None
        path = self._path(response_id)
        try:
            if time.time() - path.stat().st_mtime > self.ttl_s:
                path.unlink(missing_ok=True)
                return None
            return _decode(path.read_bytes(), response_id)
        except OSError:
            return None

    def put(self, stored: StoredResponse) -> None:
        data = stored.to_json()
        with self._lock:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, self._path(stored.id))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._evict()

    def delete(self, response_id: str) -> bool:
        if not valid_id(response_id):
            return False
        try:
            self._path(response_id).unlink()
            return True
        except FileNotFoundError:
            return False

    def _path(self, response_id: str) -> Path:
        return self.directory / f"{response_id}.json"

    def _evict(self) -> None:
        """Oldest first, past the TTL and then until the files fit the byte cap."""
        files = []
        for path in self.directory.glob("resp_*.json"):
            try:
                stat = path.stat()
            except OSError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        now = time.time()
        for mtime, size, path in files:
            if total <= self.max_bytes and now - mtime <= self.ttl_s:
                break
            path.unlink(missing_ok=True)
            total -= size


def _decode(data: bytes, response_id: str) -> StoredResponse | None:
    try:
        raw = json.loads(data)
        if (not isinstance(raw, dict) or raw.get("id") != response_id or not isinstance(raw.get("model"), str)
                or not isinstance(raw.get("items"), list) or not all(isinstance(i, dict) for i in raw["items"])
                or not isinstance(raw.get("response"), dict)):
            raise ValueError("not a stored response")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        log.warning("stored response %s is unreadable (%s); treated as missing", response_id, e)
        return None
    return StoredResponse(raw["id"], raw["model"], tuple(raw["items"]), raw["response"])
