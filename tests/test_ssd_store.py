"""SsdCacheStore policies: find rules, supersede, LRU under the byte cap, concurrency."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_ssd_cache import KvIdentity, SsdCacheStore
from tests.factories import make_plain_caches

IDENTITY = KvIdentity("model-a", "tok-a", "fp-a")


def new_store(directory: Path, max_bytes: int = 1 << 30) -> SsdCacheStore:
    return SsdCacheStore(directory, IDENTITY, max_bytes)


def test_find_returns_longest_usable_prefix_leaving_one_token_to_prefill(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    store.store(list(range(10)), make_plain_caches(10))
    store.store(list(range(20)), make_plain_caches(20), ns="other")
    hit = store.find(list(range(10)) + [99])
    assert hit is not None and (hit.num_tokens, hit.entry_tokens) == (10, 10)
    hit = store.find(list(range(10)))  # the whole prompt is cached: keep its last token to prefill
    assert hit is not None and hit.num_tokens == 9
    hit = store.find(list(range(6)) + [77, 78])  # diverges inside the entry: trim to 6
    assert hit is not None and hit.num_tokens == 6
    assert store.find([5, 6, 7]) is None and store.find([0]) is None


def test_restore_trims_to_the_hit(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    store.store(list(range(30)), make_plain_caches(30))
    restored = store.restore(store.find(list(range(12)) + [500]))  # type: ignore[arg-type]
    assert restored is not None
    assert restored.tokens == tuple(range(12)) and [c.offset for c in restored.caches] == [12, 12]


def wrapped_rotating(num_tokens: int) -> list[RotatingKVCache]:
    import mlx.core as mx

    cache = RotatingKVCache(max_size=8)
    for i in range(num_tokens):
        cache.update_and_fetch(mx.full((1, 2, 1, 32), float(i)), mx.full((1, 2, 1, 32), float(i)))
    return [cache]


def test_untrimmable_entry_is_only_used_whole(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    store.store(list(range(12)), wrapped_rotating(12))
    assert store.find(list(range(10)) + [99]) is None  # would need a trim of a wrapped ring
    hit = store.find(list(range(12)) + [99])
    assert hit is not None and hit.num_tokens == 12


def test_exact_duplicate_is_replaced_and_trimmable_entry_supersedes_ancestors(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    store.store(list(range(10)), make_plain_caches(10))
    store.store(list(range(10)), make_plain_caches(10, seed=1))
    assert store.stats().entries == 1
    store.store(list(range(20)), make_plain_caches(20))
    assert store.stats().entries == 1  # the 10-token ancestor is served by trimming the new entry
    assert store.find_exact(list(range(20))) is not None and store.find_exact(list(range(10))) is None


def test_untrimmable_entry_keeps_its_ancestors(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    store.store(list(range(10)), make_plain_caches(10))
    store.store(list(range(12)), wrapped_rotating(12))
    assert store.stats().entries == 2


def entry_size(tmp_path: Path) -> int:
    probe = new_store(tmp_path / "probe")
    probe.store([1, 2, 3], make_plain_caches(16))
    return probe.stats().bytes


def test_least_recently_used_is_evicted_under_the_cap(tmp_path: Path) -> None:
    size = entry_size(tmp_path)
    store = new_store(tmp_path / "store", max_bytes=3 * size)
    prompts = [[100 + i, 1, 2] for i in range(3)]
    for p in prompts:
        assert store.store(p, make_plain_caches(16))
    assert store.restore(store.find(prompts[0] + [9])) is not None  # type: ignore[arg-type]
    assert store.store([200, 1, 2], make_plain_caches(16))
    remaining = {tuple(p) for p in prompts + [[200, 1, 2]] if store.find_exact(p) is not None}
    assert remaining == {(100, 1, 2), (102, 1, 2), (200, 1, 2)}
    assert store.stats().evictions == 1 and store.stats().bytes <= 3 * size


def test_lru_order_survives_a_restart(tmp_path: Path) -> None:
    size = entry_size(tmp_path)
    store = new_store(tmp_path / "store", max_bytes=2 * size)
    store.store([1, 1, 1], make_plain_caches(16))
    store.store([2, 2, 2], make_plain_caches(16))
    store.restore(store.find([1, 1, 1, 9]))  # type: ignore[arg-type]
    store = new_store(tmp_path / "store", max_bytes=2 * size)
    store.store([3, 3, 3], make_plain_caches(16))
    assert store.find_exact([1, 1, 1]) is not None and store.find_exact([2, 2, 2]) is None


def test_entry_larger_than_the_cap_is_refused(tmp_path: Path) -> None:
    store = new_store(tmp_path, max_bytes=1000)
    assert store.store(list(range(10)), make_plain_caches(10)) is False
    assert list(tmp_path.rglob("*.mlxkv")) == []


def test_foreign_directories_are_never_touched(tmp_path: Path) -> None:
    foreign = tmp_path / "some-other-identity" / "base"
    foreign.mkdir(parents=True)
    (foreign / "x.mlxkv").write_bytes(b"not ours")
    store = new_store(tmp_path)
    store.store(list(range(10)), make_plain_caches(10))
    assert (foreign / "x.mlxkv").read_bytes() == b"not ours"


def test_concurrent_store_find_and_restore(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(5):
                tokens = [i, j] + list(range(8))
                assert store.store(tokens, make_plain_caches(10, seed=i))
                hit = store.find(tokens + [1])
                assert hit is not None
                restored = store.restore_async(hit).result()
                assert restored is not None and restored.tokens == tuple(tokens)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.stats().entries == 20


def test_max_bytes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes=0 must be >= 1"):
        new_store(tmp_path, max_bytes=0)


def test_equal_prefixes_go_to_the_most_recently_used_entry(tmp_path: Path) -> None:
    store = new_store(tmp_path)
    store.store([1, 2, 3, 10], make_plain_caches(4))
    store.store([1, 2, 3, 20], make_plain_caches(4))
    hit = store.find([1, 2, 3, 99, 5])
    assert hit is not None and (hit.num_tokens, hit.entry_tokens) == (3, 4)
    first = store.find_exact([1, 2, 3, 10])
    second = store.find_exact([1, 2, 3, 20])
    assert first is not None and second is not None and hit.entry_id == second.entry_id
    assert store.restore(first) is not None  # a restore makes an entry the most recent
    tied = store.find([1, 2, 3, 99, 5])
    assert tied is not None and tied.entry_id == first.entry_id
    restarted = new_store(tmp_path)  # the order survives a restart (file mtime)
    tied = restarted.find([1, 2, 3, 99, 5])
    assert tied is not None and tied.entry_id == first.entry_id
