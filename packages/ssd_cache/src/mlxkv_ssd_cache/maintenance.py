"""Directory-wide maintenance over every identity's files (the `mlxkv cache` commands).

These touch only mlxkv's own files (`*.mlxkv`, their `.tmp` orphans, `quarantine/`); anything
else in the directory is left alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mlxkv_state.errors import StateError
from mlxkv_ssd_cache.kv_file import read_file, read_header
from mlxkv_ssd_cache.layout import SUFFIX
from mlxkv_ssd_cache.scan import TMP_GRACE_S


@dataclass(frozen=True, slots=True)
class EntrySummary:
    path: Path
    size: int
    last_used: float
    model_id: str = ""
    ns: str = ""
    num_tokens: int = 0
    created_at: float = 0.0
    has_checkpoint: bool = False
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class GcReport:
    removed_tmp: int
    removed_quarantined: int
    evicted: int
    freed_bytes: int


def kv_files(root: Path) -> Iterator[Path]:
    """Every live KV file under `root` (quarantined ones excluded)."""
    if root.is_dir():
        yield from sorted(p for p in root.glob(f"*/*/*{SUFFIX}") if p.parent.name != "quarantine")


def summarize(path: Path) -> EntrySummary:
    stat = path.stat()
    try:
        header, complete = read_header(path)
    except (StateError, OSError, ValueError) as e:
        return EntrySummary(path, stat.st_size, stat.st_mtime, problem=str(e))
    return EntrySummary(
        path, stat.st_size, stat.st_mtime, header.model_id, header.ns, len(header.tokens), header.created_at,
        header.generation_checkpoint is not None, None if complete else "truncated",
    )


def verify(path: Path) -> str | None:
    """Read the whole file (every slot checksum and decode); the problem found, or None."""
    try:
        read_file(path)
    except (StateError, OSError, ValueError) as e:
        return str(e)
    return None


def gc(root: Path, max_bytes: int | None) -> GcReport:
    """Reap old tmp files, empty the quarantine, evict least recently used files over `max_bytes`."""
    now, tmp, quarantined, evicted, freed = time.time(), 0, 0, 0, 0
    for path in root.glob("*/*/*.tmp"):
        if now - path.stat().st_mtime > TMP_GRACE_S:
            freed += path.stat().st_size
            path.unlink(missing_ok=True)
            tmp += 1
    for path in root.glob("*/quarantine/*"):
        freed += path.stat().st_size
        path.unlink(missing_ok=True)
        quarantined += 1
    if max_bytes is not None:
        files = sorted(kv_files(root), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= max_bytes:
                break
            size = path.stat().st_size
            path.unlink(missing_ok=True)
            total -= size
            freed += size
            evicted += 1
    return GcReport(tmp, quarantined, evicted, freed)


def clear(root: Path) -> int:
    """Remove every mlxkv file under `root`; returns how many."""
    removed = 0
    for pattern in (f"*/*/*{SUFFIX}", "*/*/*.tmp", "*/quarantine/*"):
        for path in root.glob(pattern):
            path.unlink(missing_ok=True)
            removed += 1
    return removed
