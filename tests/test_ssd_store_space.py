"""SsdCacheStore space rules: the filesystem's free space, a full disk, checkpoints in the cap and
their expiry, identity failures leaving the index, and deletions outside the index lock."""

from __future__ import annotations

import errno
import os
import pathlib
import threading
from pathlib import Path
from typing import Any

import pytest

from mlxkv_ssd_cache import KvIdentity, SsdCacheStore, kv_file
from mlxkv_state.header import GenerationCheckpoint
from tests.factories import make_plain_caches

IDENTITY = KvIdentity("model-a", "tok-a", "fp-a")
DAY = 24 * 3600.0


def held_on_disk(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def entry_size(tmp_path: Path) -> int:
    probe = SsdCacheStore(tmp_path / "probe", IDENTITY, 1 << 30)
    assert probe.store([1, 2, 3], make_plain_caches(16))
    return probe.stats().bytes


def checkpoint(key: str) -> GenerationCheckpoint:
    return GenerationCheckpoint(cache_ns="", generated_tokens=(5, 6), key=key, original_prompt_tokens=3,
                                pending_token=7, seed=1, seed_was_explicit=False)


def prompts(n: int) -> list[list[int]]:
    return [[100 + i, 1, 2] for i in range(n)]


def stored(store: SsdCacheStore, candidates: list[list[int]]) -> list[int]:
    return [p[0] for p in candidates if store.find_exact(p) is not None]


def test_effective_cap_follows_the_free_space_of_a_small_filesystem(tmp_path: Path) -> None:
    size = entry_size(tmp_path)
    directory = tmp_path / "cache"
    capacity = int(3.5 * size)  # a filesystem that holds three entries and a half

    def small_filesystem(_: Path) -> int:
        return capacity - held_on_disk(directory)

    store = SsdCacheStore(directory, IDENTITY, 1 << 30, reserve_bytes=0, free_space=small_filesystem)
    assert store.effective_max_bytes() == capacity
    for p in prompts(5):
        assert store.store(p, make_plain_caches(16))
    assert stored(store, prompts(5)) == [102, 103, 104]  # the oldest made room
    assert store.stats().evictions == 2 and held_on_disk(directory) <= capacity
    assert store.effective_max_bytes() == capacity
    reserved = SsdCacheStore(directory, IDENTITY, 1 << 30, reserve_bytes=size, free_space=small_filesystem)
    assert reserved.effective_max_bytes() == capacity - size
    assert stored(reserved, prompts(5)) == [103, 104]  # a restart enforces the effective cap too


def test_full_disk_evicts_older_entries_and_the_write_succeeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = entry_size(tmp_path)
    directory = tmp_path / "cache"
    write = getattr(kv_file, "write_kv_file")

    def small_disk_write(out: Any, *args: Any, **kwargs: Any) -> Any:
        if held_on_disk(directory) + size > int(2.5 * size):
            out.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(out, *args, **kwargs)

    monkeypatch.setattr("mlxkv_ssd_cache.kv_file.write_kv_file", small_disk_write)
    store = SsdCacheStore(directory, IDENTITY, 1 << 30)  # the real free space is large: only ENOSPC tells
    for p in prompts(4):
        assert store.store(p, make_plain_caches(16))
    assert stored(store, prompts(4)) == [102, 103]
    assert store.stats().evictions == 2
    assert list(directory.rglob("*.tmp")) == []


def test_checkpoints_count_in_the_cap_and_age_out_least_recently_used_first(tmp_path: Path) -> None:
    size = entry_size(tmp_path)
    store = SsdCacheStore(tmp_path / "cache", IDENTITY, max_bytes=3 * size + size // 2)
    assert store.save_checkpoint([1, 2, 3], make_plain_caches(16), checkpoint("aa"))
    assert store.save_checkpoint([1, 2, 3], make_plain_caches(16), checkpoint("bb"))
    assert store.store(prompts(1)[0], make_plain_caches(16))
    stats = store.stats()
    assert (stats.entries, stats.checkpoints, stats.evictions) == (1, 2, 0)
    assert stats.bytes == held_on_disk(tmp_path / "cache")
    assert store.save_checkpoint([1, 2, 3], make_plain_caches(16), checkpoint("aa"))  # rewritten: most recent
    assert store.store(prompts(2)[1], make_plain_caches(16))
    assert store.load_checkpoint("bb") is None and store.load_checkpoint("aa") is not None
    assert (store.stats().checkpoints, store.stats().entries, store.stats().evictions) == (1, 2, 1)
    assert not (store.root / "checkpoints" / "bb.mlxkv").exists()


def test_checkpoint_not_rewritten_for_its_ttl_expires(tmp_path: Path) -> None:
    now = [1_000_000.0]
    store = SsdCacheStore(tmp_path, IDENTITY, 1 << 30, checkpoint_ttl_s=DAY, clock=lambda: now[0])
    assert store.save_checkpoint([1, 2, 3], make_plain_caches(16), checkpoint("aa"))
    now[0] += DAY - 60
    assert store.save_checkpoint([1, 2, 3], make_plain_caches(16), checkpoint("bb"))
    now[0] += 120  # "aa" is a day and a minute old, "bb" two minutes
    assert store.load_checkpoint("aa") is None
    assert not (store.root / "checkpoints" / "aa.mlxkv").exists()
    assert store.load_checkpoint("bb") is not None
    now[0] += DAY
    assert store.store(prompts(1)[0], make_plain_caches(16))  # any write expires what is due
    assert not (store.root / "checkpoints" / "bb.mlxkv").exists()
    assert (store.stats().checkpoints, store.stats().expired_checkpoints) == (0, 2)


def test_expired_checkpoint_is_removed_at_start_up(tmp_path: Path) -> None:
    store = SsdCacheStore(tmp_path, IDENTITY, 1 << 30)
    assert store.save_checkpoint([1, 2, 3], make_plain_caches(16), checkpoint("aa"))
    assert store.save_checkpoint([1, 2, 3], make_plain_caches(16), checkpoint("bb"))
    old = (store.root / "checkpoints" / "aa.mlxkv").stat().st_mtime - DAY - 1
    os.utime(store.root / "checkpoints" / "aa.mlxkv", (old, old))
    restarted = SsdCacheStore(tmp_path, IDENTITY, 1 << 30)
    assert not (store.root / "checkpoints" / "aa.mlxkv").exists()
    assert restarted.load_checkpoint("aa") is None and restarted.load_checkpoint("bb") is not None
    assert (restarted.stats().checkpoints, restarted.stats().expired_checkpoints) == (1, 1)


def test_checkpoint_ttl_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint_ttl_s=0 must be > 0"):
        SsdCacheStore(tmp_path, IDENTITY, 1 << 30, checkpoint_ttl_s=0)


def test_entry_failing_the_identity_check_on_restore_leaves_the_index(tmp_path: Path) -> None:
    store = SsdCacheStore(tmp_path, IDENTITY, 1 << 30)
    assert store.store(list(range(10)), make_plain_caches(10))
    other = SsdCacheStore(tmp_path, KvIdentity("model-b", "tok-a", "fp-a"), 1 << 30)
    assert other.store(list(range(10)), make_plain_caches(10))
    ours = next(store.root.rglob("*.mlxkv"))
    os.replace(next(other.root.rglob("*.mlxkv")), ours)  # replaced behind the store's back
    hit = store.find(list(range(10)) + [1])
    assert hit is not None and store.restore(hit) is None
    assert store.find(list(range(10)) + [1]) is None  # dropped: never read again
    assert not ours.exists() and [p.name for p in (store.root / "quarantine").iterdir()] == [ours.name]
    assert (store.stats().entries, store.stats().quarantined) == (0, 1)


def test_files_are_deleted_outside_the_index_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = entry_size(tmp_path)
    store = SsdCacheStore(tmp_path / "cache", IDENTITY, max_bytes=2 * size)
    assert store.store([1, 2], make_plain_caches(16))
    assert store.store([9, 9, 9], make_plain_caches(16))
    real_unlink = pathlib.Path.unlink
    finds_during_unlink: list[bool] = []

    def unlink_while_finding(path: Path, missing_ok: bool = False) -> None:
        if path.suffix == ".mlxkv":
            finder = threading.Thread(target=store.find, args=([9, 9, 9, 1],))
            finder.start()
            finder.join(30)  # with the lock held here, find could never return
            finds_during_unlink.append(not finder.is_alive())
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink_while_finding)
    assert store.store([1, 2, 3], make_plain_caches(16))  # makes room: [1, 2] goes
    assert store.store([5, 5, 5], make_plain_caches(16))  # makes room: [9, 9, 9] goes
    hit = store.find([5, 5, 5, 1])
    assert hit is not None
    store.remove(hit)
    monkeypatch.setattr(pathlib.Path, "unlink", real_unlink)
    assert finds_during_unlink == [True, True, True]
    assert [p.name for p in (tmp_path / "cache").rglob("*.mlxkv")] == [
        p.name for p in store.root.rglob("*.mlxkv")
    ] and len(list(store.root.rglob("*.mlxkv"))) == 1 and store.find_exact([1, 2, 3]) is not None


def test_checkpoint_written_by_another_process_is_found_and_counted(tmp_path: Path) -> None:
    store = SsdCacheStore(tmp_path, IDENTITY, 1 << 30)
    other = SsdCacheStore(tmp_path, IDENTITY, 1 << 30)  # another server of the same identity
    assert other.save_checkpoint([1, 2, 3], make_plain_caches(16), checkpoint("aa"))
    restored = store.load_checkpoint("aa")
    assert restored is not None and restored.tokens == (1, 2, 3)
    assert store.stats().checkpoints == 1 and store.stats().bytes == held_on_disk(store.root)
