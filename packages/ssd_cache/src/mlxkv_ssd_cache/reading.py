"""Reading the store's files back: a file that is gone is forgotten; one that fails to read or
fails the identity guard leaves the index and is quarantined, so it is never read again."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.prefix_index import Indexed
from mlxkv_state.errors import StateError
from mlxkv_state.header import KvFileHeader
from mlxkv_ssd_cache.files import StoreFiles
from mlxkv_ssd_cache.index import Item, StoreIndex
from mlxkv_ssd_cache.kv_file import Attachments, KvIdentity, identity_problem, read_file
from mlxkv_ssd_cache.layout import CHECKPOINT_KEY_PREFIX
from mlxkv_ssd_cache.scan import StoredFile

log = logging.getLogger(__name__)

Loaded = tuple[KvFileHeader, list[LayerCache], Attachments]


class GuardedReader:
    def __init__(self, index: StoreIndex, files: StoreFiles, identity: KvIdentity) -> None:
        self._index = index
        self._files = files
        self._identity = identity

    def read(self, item: Item) -> Loaded | None:
        """A whole file, or None: gone (forgotten) or unreadable (logged and quarantined)."""
        path = item.value.path
        try:
            return read_file(path)
        except FileNotFoundError:
            self._index.remove(item.key)
            return None
        except (StateError, OSError, ValueError) as e:
            log.warning("KV file %s is unreadable (%s); quarantined", path.name, e)
            self.quarantine(item)
            return None

    def refused(self, item: Item, header: KvFileHeader, ns: str, tokens: Sequence[int]) -> bool:
        """Whether a file read back fails the identity guard (it is then quarantined)."""
        problem = identity_problem(self._identity, header, ns, tokens)
        if problem is None:
            return False
        log.warning("KV file %s not restored: %s; quarantined", item.value.path.name, problem)
        self.quarantine(item)
        return True

    def checkpoint(self, key: str) -> Item | None:
        """The index entry of `key`'s checkpoint; a file this store did not write (another process
        of this identity wrote it, or it was put back by hand) is indexed, its mtime its last write."""
        item = self._index.get(CHECKPOINT_KEY_PREFIX + key)
        if item is not None:
            return item
        path = self._files.checkpoint_path(key)
        try:
            stat = path.stat()
        except OSError:
            return None
        item = Indexed(CHECKPOINT_KEY_PREFIX + key, "", (), stat.st_size, 0, False,
                       StoredFile(path, "checkpoint", stat.st_mtime))
        self._index.add(item)
        return item

    def touch(self, item: Item) -> None:
        """Make `item` the most recently used, in the index and (through mtime) across restarts."""
        self._index.touch(item.key)
        self._files.touch(item.value.path)

    def quarantine(self, source: Item | Path) -> None:
        if isinstance(source, Path):
            path = source
        else:
            path = source.value.path
            self._index.remove(source.key)
        self._files.quarantine(path)
        self._index.count_quarantined()
