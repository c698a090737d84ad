"""The stored-response stores (disk and memory): round trip, byte cap (oldest out), TTL, corrupt
files as misses, ids that could name other files. Model-free."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mlxkv_serve.responses_store import DiskResponseStore, MemoryResponseStore, ResponseStore, StoredResponse


def stored(n: int, text: str = "x") -> StoredResponse:
    items = ({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},)
    return StoredResponse(f"resp_{n:032x}", "m", items, {"id": f"resp_{n:032x}", "output": []})


@pytest.fixture(params=["disk", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ResponseStore:
    if request.param == "disk":
        return DiskResponseStore(tmp_path / "responses", max_bytes=1000)
    return MemoryResponseStore(max_bytes=1000)


def test_round_trip_and_delete(store: ResponseStore) -> None:
    store.put(stored(1, "héllo"))
    assert store.get(stored(1).id) == stored(1, "héllo")
    assert store.delete(stored(1).id) is True
    assert store.get(stored(1).id) is None and store.delete(stored(1).id) is False


def test_byte_cap_drops_the_oldest_first(store: ResponseStore, tmp_path: Path) -> None:
    size = len(stored(0, "a" * 200).to_json())
    for n in range(1000 // size + 2):
        store.put(stored(n, "a" * 200))
        if isinstance(store, DiskResponseStore):  # mtimes order the files: make them distinct
            os.utime(store.directory / f"{stored(n).id}.json", (time.time() - 100 + n, time.time() - 100 + n))
    kept = [n for n in range(1000 // size + 2) if store.get(stored(n).id) is not None]
    assert kept == list(range(1000 // size + 2 - len(kept), 1000 // size + 2)) and len(kept) == 1000 // size


def test_expired_responses_are_missing(tmp_path: Path) -> None:
    disk = DiskResponseStore(tmp_path / "r", ttl_s=60)
    disk.put(stored(1))
    old = time.time() - 120
    os.utime(disk.directory / f"{stored(1).id}.json", (old, old))
    assert disk.get(stored(1).id) is None and not (disk.directory / f"{stored(1).id}.json").exists()


@pytest.mark.parametrize("content", [b"", b"{", b"[]", b'{"id": "resp_00000000000000000000000000000001"}',
                                     b'{"id": "resp_00000000000000000000000000000002", "model": "m", "items": [], "response": {}}',
                                     b"\xff\xfe"])
def test_corrupt_file_is_a_miss(tmp_path: Path, content: bytes) -> None:
    disk = DiskResponseStore(tmp_path / "r")
    (disk.directory / f"{stored(1).id}.json").write_bytes(content)
    assert disk.get(stored(1).id) is None


@pytest.mark.parametrize("bad_id", ["../x", "resp_../../etc/passwd", "resp_XYZ", ""])
def test_ids_that_are_not_ours_name_no_file(tmp_path: Path, bad_id: str) -> None:
    disk = DiskResponseStore(tmp_path / "r")
    assert disk.get(bad_id) is None and disk.delete(bad_id) is False


def test_a_byte_cap_below_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes=0"):
        DiskResponseStore(tmp_path, max_bytes=0)
    with pytest.raises(ValueError, match="max_bytes=0"):
        MemoryResponseStore(max_bytes=0)
