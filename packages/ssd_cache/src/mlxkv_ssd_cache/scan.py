"""Start-up scan of one identity's directory: headers only, oldest file first."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mlxkv_inference.cache.prefix_index import Indexed
from mlxkv_state.errors import StateError
from mlxkv_ssd_cache.kv_file import KvIdentity, identity_problem, read_header
from mlxkv_ssd_cache.layout import CHECKPOINT_DIR, CHECKPOINT_KEY_PREFIX, QUARANTINE_DIR, SUFFIX, expected_id

log = logging.getLogger(__name__)

TMP_GRACE_S = 60.0  # a younger .tmp may belong to a writer in another process

Kind = Literal["prompt", "object", "checkpoint"]


@dataclass(slots=True)
class StoredFile:
    """What the store's index keeps about one file."""

    path: Path
    kind: Kind
    written_at: float  # for checkpoints: the time of the last write (their expiry clock)


@dataclass(slots=True)
class Scanned:
    items: list[Indexed[str, StoredFile]] = field(default_factory=list)  # least recently used first
    bad: list[Path] = field(default_factory=list)  # unreadable or truncated: to quarantine


def scan_identity_dir(root: Path, identity: KvIdentity) -> Scanned:
    """Index entries for `identity`'s files under `root`, ordered by mtime (the LRU order a
    restart keeps); old .tmp orphans are removed, files of another identity are left alone."""
    now, found, out = time.time(), [], Scanned()
    for directory in [d for d in root.iterdir() if d.is_dir() and d.name != QUARANTINE_DIR]:
        for path in directory.iterdir():
            if path.name.endswith(".tmp"):
                if now - path.stat().st_mtime > TMP_GRACE_S:
                    path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                item = _index_file(path, identity, directory.name == CHECKPOINT_DIR, out.bad)
                if item is not None:
                    found.append((path.stat().st_mtime_ns, path.name, item))
    out.items = [item for _, _, item in sorted(found, key=lambda f: f[:2])]
    return out


def _index_file(path: Path, identity: KvIdentity, checkpoint: bool, bad: list[Path]) -> Indexed[str, StoredFile] | None:
    try:
        header, complete = read_header(path)
    except (StateError, OSError, ValueError) as e:
        log.warning("KV file %s has a bad header (%s); quarantined", path.name, e)
        bad.append(path)
        return None
    if not complete:
        log.warning("KV file %s is truncated; quarantined", path.name)
        bad.append(path)
        return None
    stat = path.stat()
    if checkpoint:
        ckpt = header.generation_checkpoint
        if ckpt is None or ckpt.key != path.stem or identity_problem(identity, header, ckpt.cache_ns, header.tokens):
            return None  # not a checkpoint of this identity: not ours to use or delete
        return Indexed(CHECKPOINT_KEY_PREFIX + ckpt.key, ckpt.cache_ns, (), stat.st_size, 0, False,
                       StoredFile(path, "checkpoint", stat.st_mtime))
    if identity_problem(identity, header, header.ns, header.tokens) is not None or path.stem != expected_id(header):
        return None  # another identity's or a renamed file: not ours to use or delete
    kind: Kind = "prompt" if header.tokens else "object"
    return Indexed(path.stem, header.ns, header.tokens, stat.st_size, header.minimum_reusable_offset,
                   header.trimmable, StoredFile(path, kind, stat.st_mtime))
