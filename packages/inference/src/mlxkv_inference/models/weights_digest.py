"""Content identity of weight files: xxh3-128 of every byte, remembered across restarts.

Two fine-tunes of one base can share a file's size, first and last MiB: only the whole content
tells them apart. Hashing runs at several GB/s, and a small JSON memo keyed by
(path, size, mtime_ns, inode) spares a restart from re-reading a large model:

    {"version": 1, "files": {"/abs/model.gguf": {"size": .., "mtime_ns": .., "inode": .., "xxh3_128": ".."}}}

A memo that cannot be read or parsed is ignored and rewritten; one that cannot be written costs
only the re-read next time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import xxhash

log = logging.getLogger(__name__)

MEMO_VERSION = 1
_CHUNK = 8 << 20


def weights_digest(files: Iterable[Path], memo_path: Path | None = None) -> str:
    """One digest over the full contents of `files` (in order; names are not part of it)."""
    memo = _load_memo(memo_path) if memo_path is not None else {}
    before = dict(memo)
    digest = hashlib.sha256()
    for f in files:
        stat = f.stat()
        digest.update(f"{stat.st_size}\0{file_digest(f, memo)}\0".encode())
    if memo_path is not None and memo != before:
        _save_memo(memo_path, memo)
    return digest.hexdigest()


def file_digest(path: Path, memo: dict[str, dict[str, Any]]) -> str:
    """xxh3-128 hex of `path`'s bytes, from `memo` when its size, mtime and inode still match."""
    key = str(path.resolve())
    stat = path.stat()
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    known = memo.get(key)
    if known is not None and all(known.get(k) == v for k, v in stamp.items()) and isinstance(known.get("xxh3_128"), str):
        return str(known["xxh3_128"])
    hasher = xxhash.xxh3_128()
    with path.open("rb", buffering=0) as fh:
        while chunk := fh.read(_CHUNK):
            hasher.update(chunk)
    memo[key] = {**stamp, "xxh3_128": hasher.hexdigest()}
    return hasher.hexdigest()


def _load_memo(path: Path) -> dict[str, dict[str, Any]]:
    try:
        blob = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    files = blob.get("files") if isinstance(blob, dict) and blob.get("version") == MEMO_VERSION else None
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, dict)}


def _save_memo(path: Path, memo: dict[str, dict[str, Any]]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": MEMO_VERSION, "files": memo}, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("weights digest memo %s not written: %s", path, e)
        tmp.unlink(missing_ok=True)
