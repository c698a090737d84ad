"""The store's file operations under one identity's directory: where each file goes, atomic
writes, files from elsewhere put in place, quarantine. No index here: the store keeps the two in step."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_state.errors import StateError
from mlxkv_state.header import KvFileHeader
from mlxkv_ssd_cache.kv_file import Attachments, write_file_atomically, read_header
from mlxkv_ssd_cache.layout import (
    CHECKPOINT_DIR, QUARANTINE_DIR, SUFFIX, entry_id, make_private_dir, ns_key, object_id,
)
from mlxkv_ssd_cache.slot_codec import SlotPolicy

log = logging.getLogger(__name__)


class StoreFiles:
    def __init__(self, root: Path, policy: SlotPolicy) -> None:
        self.root = root
        self._policy = policy
        make_private_dir(root)

    def prompt_path(self, ns: str, tokens: Sequence[int]) -> Path:
        return self.root / ns_key(ns) / f"{entry_id(ns, tokens)}{SUFFIX}"

    def object_path(self, ns: str, key: str) -> Path:
        return self.root / ns_key(ns) / f"{object_id(ns, key)}{SUFFIX}"

    def checkpoint_path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"checkpoint key {key!r} must be a hex digest")
        return self.root / CHECKPOINT_DIR / f"{key}{SUFFIX}"

    def write(
        self, path: Path, header: KvFileHeader, caches: Sequence[LayerCache], attachments: Attachments | None,
        on_full: Callable[[], bool],
    ) -> tuple[KvFileHeader, int]:
        """`write_file_atomically`; on a full disk call `on_full` (which makes room) and try again
        while it says it did. (header written, file size); raises OSError, StateError, ValueError."""
        make_private_dir(path.parent)
        while True:
            try:
                written = write_file_atomically(path, header, caches, attachments, self._policy)
                return written, path.stat().st_size
            except OSError as e:
                if e.errno != errno.ENOSPC or not on_full():
                    raise

    def place(self, data: bytes, path: Path, problem_of: Callable[[KvFileHeader], str | None]) -> KvFileHeader | None:
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

    def quarantine(self, path: Path) -> None:
        """Move a file that failed to read aside, so it is never read again."""
        target = self.root / QUARANTINE_DIR
        try:
            make_private_dir(target)
            os.replace(path, target / path.name)
        except OSError as e:
            log.warning("could not quarantine %s: %s", path, e)

    @staticmethod
    def touch(path: Path) -> None:
        now = time.time()
        try:
            os.utime(path, (now, now))  # LRU order survives restarts through mtime
        except OSError:
            pass
