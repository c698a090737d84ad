"""Fault table: every bad file or failing write leaves the store usable and raises nothing."""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlxkv_ssd_cache import KvIdentity, SsdCacheStore
from mlxkv_ssd_cache import kv_file
from mlxkv_ssd_cache.container import read_kv_header
from tests.factories import make_plain_caches

IDENTITY = KvIdentity("model-a", "tok-a", "fp-a")
TOKENS = list(range(64))


def new_store(directory: Path, max_bytes: int = 1 << 30) -> SsdCacheStore:
    return SsdCacheStore(directory, IDENTITY, max_bytes)


def stored_file(directory: Path) -> Path:
    assert new_store(directory).store(TOKENS, make_plain_caches(64))
    return next(directory.rglob("*.mlxkv"))


def data_start(path: Path) -> int:
    with path.open("rb") as f:
        return read_kv_header(f)[1]


def flip(path: Path, at: Callable[[Path], int]) -> None:
    blob = bytearray(path.read_bytes())
    blob[at(path)] ^= 0x40
    path.write_bytes(bytes(blob))


def truncate(path: Path, at: Callable[[Path], int]) -> None:
    path.write_bytes(path.read_bytes()[: at(path)])


FAULTS: dict[str, Callable[[Path], None]] = {
    "flipped byte in the magic": lambda p: flip(p, lambda _: 2),
    "flipped byte in the header": lambda p: flip(p, lambda _: 40),
    "flipped byte in a slot": lambda p: flip(p, lambda q: data_start(q) + 100),
    "flipped byte in the last slot": lambda p: flip(p, lambda q: q.stat().st_size - 70),
    "truncated in the prefix": lambda p: truncate(p, lambda _: 10),
    "truncated in the header": lambda p: truncate(p, lambda _: 60),
    "truncated at the data start": lambda p: truncate(p, data_start),
    "truncated mid-slot": lambda p: truncate(p, lambda q: data_start(q) + 1000),
    "truncated by one byte": lambda p: truncate(p, lambda q: q.stat().st_size - 65),
    "empty file": lambda p: truncate(p, lambda _: 0),
    "not a KV file": lambda p: flip(p, lambda _: 0),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_bad_file_is_a_miss_and_is_quarantined(fault: str, tmp_path: Path) -> None:
    path = stored_file(tmp_path)
    FAULTS[fault](path)
    store = new_store(tmp_path)  # a restart: the scan reads headers only
    hit = store.find(TOKENS + [1])
    if hit is not None:  # a slot fault passes the header scan and is caught on restore
        assert store.restore(hit) is None
        assert store.find(TOKENS + [1]) is None
    assert not path.exists()
    assert len(list((store.root / "quarantine").iterdir())) == 1
    assert store.stats().quarantined == 1
    # still usable
    assert store.store(TOKENS, make_plain_caches(64))
    restored = store.restore(store.find(TOKENS + [1]))  # type: ignore[arg-type]
    assert restored is not None and restored.tokens == tuple(TOKENS)


def test_tmp_left_by_a_killed_writer_is_reaped(tmp_path: Path) -> None:
    path = stored_file(tmp_path)
    orphan = path.with_name(path.name + ".123.456.tmp")
    orphan.write_bytes(path.read_bytes()[:500])
    young = path.with_name(path.name + ".789.1.tmp")
    young.write_bytes(b"in progress")
    old = time.time() - 3600
    os.utime(orphan, (old, old))
    store = new_store(tmp_path)
    assert not orphan.exists()
    assert young.exists()  # may belong to a live writer in another process
    assert store.find(TOKENS + [1]) is not None


def test_full_disk_returns_false_and_leaves_nothing_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = new_store(tmp_path)
    real = getattr(kv_file, "write_kv_file")

    def write_then_fill_disk(out: Any, *args: Any, **kwargs: Any) -> Any:
        out.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("mlxkv_ssd_cache.kv_file.write_kv_file", write_then_fill_disk)
    assert store.store(TOKENS, make_plain_caches(64)) is False
    assert list(tmp_path.rglob("*.mlxkv")) == [] and list(tmp_path.rglob("*.tmp")) == []
    assert store.find(TOKENS + [1]) is None
    monkeypatch.setattr("mlxkv_ssd_cache.kv_file.write_kv_file", real)
    assert store.store(TOKENS, make_plain_caches(64))


def test_unwritable_directory_returns_false(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    blocker = store.root / "base"
    blocker.write_bytes(b"a file where the namespace directory should be")
    assert store.store(TOKENS, make_plain_caches(64)) is False


def test_files_are_private(tmp_path: Path) -> None:
    path = stored_file(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700
