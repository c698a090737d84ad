"""The remote tier's store against real Redis and real SeaweedFS (S3) on loopback, model-free:
first writer wins, parts behind a manifest, nothing unchecked is ever returned, the breaker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from mlxkv_remote_cache import (
    CircuitBreaker, EntryInfo, IndexMirror, RedisBackend, RemoteBackend, RemoteConfig, RemoteStore,
    RemoteUnavailableError, S3Backend, open_backend,
)
from mlxkv_remote_cache.backend import IndexEvents
from mlxkv_remote_cache.keys import MANIFEST, entry_prefix, part_key
from tests.remote_servers import RedisServer, SeaweedS3, redis_server, seaweed_s3  # noqa: F401 - fixtures
from tests.serving import free_port

PART = 1000
DATA = bytes(range(256)) * 10  # 2,560 bytes: three parts of PART
TOKENS = (1, 2, 3, 4, 5)


@pytest.fixture(params=["redis", "s3"])
def backend(request: pytest.FixtureRequest) -> Iterator[RemoteBackend]:
    server = request.getfixturevalue("redis_server" if request.param == "redis" else "seaweed_s3")
    opened = open_backend(server.url)
    yield opened
    opened.close()


def make_store(backend: RemoteBackend, identity: str, **config: object) -> RemoteStore:
    return RemoteStore(backend, identity, RemoteConfig(**{"part_bytes": PART, **config}))  # type: ignore[arg-type]


def fresh_identity() -> str:
    return uuid.uuid4().hex


def put(store: RemoteStore, data: bytes = DATA, entry: str = "ab" * 16) -> EntryInfo:
    assert store.put_entry("base", entry, "", TOKENS, data, 0, True)
    found = [e for e in store.list_entries() if e.manifest.name == entry]
    assert len(found) == 1
    return found[0]


def test_backends_are_remote_backends() -> None:
    backends: list[type[RemoteBackend]] = [RedisBackend, S3Backend]
    assert [b.__name__ for b in backends] == ["RedisBackend", "S3Backend"]
    assert issubclass(RedisBackend, IndexEvents) and not issubclass(S3Backend, IndexEvents)


def test_entry_in_parts_round_trips_and_lists(backend: RemoteBackend) -> None:
    store = make_store(backend, fresh_identity())
    info = put(store)
    assert info.manifest.part_sizes == (1000, 1000, 560)
    assert (info.ns_key, info.manifest.tokens, info.manifest.trimmable) == ("base", TOKENS, True)
    assert store.get_entry(info) == DATA
    assert store.stats().get_bytes == len(DATA)


def test_first_writer_wins(backend: RemoteBackend) -> None:
    identity = fresh_identity()
    first, second = make_store(backend, identity), make_store(backend, identity)
    info = put(first)
    assert not second.put_entry("base", "ab" * 16, "", TOKENS, b"other bytes", 0, True)
    assert second.get_entry(info) == DATA
    # the loser left no parts of its own behind
    assert sorted(backend.list(entry_prefix(identity, "base", "ab" * 16))) == sorted(
        [entry_prefix(identity, "base", "ab" * 16) + MANIFEST]
        + [part_key(entry_prefix(identity, "base", "ab" * 16), first.writer, i) for i in range(3)])


def test_evicted_part_behind_a_present_manifest_is_a_miss(backend: RemoteBackend) -> None:
    store = make_store(backend, fresh_identity())
    info = put(store)
    backend.delete([part_key(entry_prefix(store.identity_key, "base", info.manifest.name), store.writer, 1)])
    assert store.get_entry(info) is None
    assert store.stats().bad_objects == 1


@pytest.mark.parametrize("damage", ["flipped", "truncated", "grown"])
def test_damaged_part_is_a_miss(backend: RemoteBackend, damage: str) -> None:
    store = make_store(backend, fresh_identity())
    info = put(store)
    key = part_key(entry_prefix(store.identity_key, "base", info.manifest.name), store.writer, 0)
    part = DATA[:PART]
    backend.put(key, {"flipped": bytes([part[0] ^ 1]) + part[1:], "truncated": part[:-1], "grown": part + b"!"}[damage], 60)
    assert store.get_entry(info) is None
    assert store.stats().bad_objects == 1


@pytest.mark.parametrize("manifest", [b"not json", b'{"version": 1}', b"[]", b'{"version": 99}'])
def test_foreign_manifest_is_a_miss(backend: RemoteBackend, manifest: bytes) -> None:
    store = make_store(backend, fresh_identity())
    info = put(store)
    backend.put(entry_prefix(store.identity_key, "base", info.manifest.name) + MANIFEST, manifest, 60)
    assert store.get_entry(info) is None
    assert store.list_entries() == []
    assert store.stats().bad_objects == 2


def test_manifest_claiming_parts_over_the_limit_is_a_miss(backend: RemoteBackend) -> None:
    identity = fresh_identity()
    writer = make_store(backend, identity, part_bytes=2 * PART)
    reader = make_store(backend, identity)
    assert writer.put_entry("base", "cd" * 16, "", TOKENS, DATA, 0, True)
    assert reader.list_entries() == []
    assert reader.stats().bad_objects == 1


def test_signed_entries_need_the_key(backend: RemoteBackend) -> None:
    identity = fresh_identity()
    key = b"k" * 32
    signer = make_store(backend, identity, hmac_key=key)
    info = put(signer)
    assert make_store(backend, identity, hmac_key=key).get_entry(info) == DATA
    assert make_store(backend, identity, hmac_key=b"x" * 32).get_entry(info) is None
    unsigned = make_store(backend, fresh_identity())
    plain = put(unsigned)
    assert make_store(backend, unsigned.identity_key, hmac_key=key).get_entry(plain) is None


def test_only_the_writer_deletes(backend: RemoteBackend) -> None:
    identity = fresh_identity()
    writer, other = make_store(backend, identity), make_store(backend, identity)
    info = put(writer)
    assert not other.remove_entry(info)
    assert other.get_entry(info) == DATA
    assert writer.remove_entry(info)
    assert other.get_entry(info) is None
    assert backend.list(entry_prefix(identity, "base", info.manifest.name)) == []


def test_checkpoint_versions_replace_each_other(backend: RemoteBackend) -> None:
    identity = fresh_identity()
    store, other = make_store(backend, identity), make_store(backend, identity)
    key = "ef" * 32
    assert store.save_checkpoint(key, "", (1, 2), b"first" * 300)
    assert store.save_checkpoint(key, "", (1, 2, 3), b"second" * 300)
    assert other.load_checkpoint(key) == b"second" * 300
    # the older version's keys are gone: one manifest, its parts and the pointer remain
    assert len(backend.list(f"mlxkv-kv1/{identity}/checkpoints/{key}/")) == 1 + 2 + 1
    other.remove_checkpoint(key)
    assert store.load_checkpoint(key) is None


def test_mirror_follows_another_replicas_puts(backend: RemoteBackend) -> None:
    identity = fresh_identity()
    writer, reader = make_store(backend, identity), make_store(backend, identity)
    put(writer, entry="01" * 16)
    seen: dict[str, EntryInfo] = {}

    class Listener:
        def reset(self, entries: list[EntryInfo]) -> None:
            seen.clear()
            seen.update({e.manifest.name: e for e in entries})

        def put(self, entry: EntryInfo) -> None:
            seen[entry.manifest.name] = entry

        def remove(self, ns_key: str, entry_id: str) -> None:
            seen.pop(entry_id, None)

    mirror = IndexMirror(reader, Listener(), poll_s=0.2, block_ms=100).start()
    try:
        assert mirror.ready.wait(10)
        assert sorted(seen) == ["01" * 16]
        put(writer, entry="02" * 16)
        assert wait_for(lambda: "02" * 16 in seen)
        writer.remove_entry(seen["01" * 16])
        assert wait_for(lambda: sorted(seen) == ["02" * 16])
    finally:
        mirror.close()


def test_redis_keys_carry_a_ttl_refreshed_on_hits(redis_server: RedisServer) -> None:
    store = make_store(RedisBackend(redis_server.url), fresh_identity(), ttl_s=100)
    info = put(store)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    keys: list[str] = list(client.keys(f"mlxkv-kv1/{store.identity_key}/*"))  # type: ignore[arg-type]
    assert len(keys) == 5 and all(0 < client.ttl(k) <= 100 for k in keys)  # manifest, 3 parts, the index log
    keys = [k for k in keys if not k.endswith("/events")]
    for k in keys:
        client.expire(k, 5)
    assert store.get_entry(info) == DATA
    assert all(client.ttl(k) > 5 for k in keys)


def test_redis_evicting_parts_under_memory_pressure_never_serves_a_partial_entry(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "10")
    try:
        client = redis.Redis.from_url(server.url)
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 900_000)
        store = make_store(RedisBackend(server.url), fresh_identity(), part_bytes=10_000)
        written: dict[str, bytes] = {}
        # 40 entries of 30 kB (3 parts) into ~900 kB. NOTE: Redis's LRU clock ticks once a second, so in
        # this sub-second run eviction picks among equals: some entries lose parts, some manifests, some nothing
        for i in range(40):
            name, data = f"{i:032x}", bytes([i]) * 30_000
            assert store.put_entry("base", name, "", (i, 1, 2), data, 0, True)
            written[name] = data
        assert int(client.info("stats")["evicted_keys"]) > 0
        outcomes = []
        for name, data in written.items():
            base = entry_prefix(store.identity_key, "base", name)
            parts = [part_key(base, store.writer, i) for i in range(3)]
            complete = client.exists(base + MANIFEST) == 1 and client.exists(*parts) == 3
            info = store.entry_at(base + MANIFEST)
            outcomes.append((info is not None, complete))
            assert (store.get_entry(info) if info is not None else None) == (data if complete else None)
        assert (True, False) in outcomes and (True, True) in outcomes  # a manifest without its parts: a miss
    finally:
        server.stop()


def test_entry_older_than_its_ttl_is_a_miss_where_the_store_keeps_keys(backend: RemoteBackend) -> None:
    identity = fresh_identity()
    writer = make_store(backend, identity, ttl_s=60)
    info = put(writer)
    assert writer.save_checkpoint("ef" * 16, "", TOKENS, DATA)
    later = RemoteStore(backend, identity, RemoteConfig(part_bytes=PART, ttl_s=60), clock=lambda: time.time() + 61)
    if backend.expires_keys:  # Redis drops the keys itself (TTLs refreshed on hits): what is there is fresh
        assert (later.get_entry(info), later.load_checkpoint("ef" * 16)) == (DATA, DATA)
        assert [e.manifest.name for e in later.list_entries()] == [info.manifest.name] and later.stats().expired == 0
    else:  # S3 keeps objects until a lifecycle rule removes them: the manifest's age decides
        assert (later.get_entry(info), later.load_checkpoint("ef" * 16), later.list_entries()) == (None, None, [])
        assert (later.stats().expired, later.stats().bad_objects) == (3, 0)
    assert writer.get_entry(info) == DATA  # within its TTL


def test_dead_backend_fails_fast_then_the_breaker_stops_asking(tmp_path: object) -> None:
    port = free_port()  # nothing listens there
    store = RemoteStore(RedisBackend(f"redis://127.0.0.1:{port}/0"), fresh_identity(),
                        breaker=CircuitBreaker(failures_to_open=2, open_s=60))
    for _ in range(2):
        with pytest.raises(RemoteUnavailableError):
            store.put_entry("base", "ab" * 16, "", TOKENS, DATA, 0, True)
    assert (store.breaker.state, store.stats().failures) == ("open", 2)
    with pytest.raises(RemoteUnavailableError, match="circuit open"):
        store.load_checkpoint("ab" * 32)
    assert (store.stats().failures, store.stats().skipped) == (2, 1)
    assert not store.healthy()


def test_breaker_probes_and_closes_when_redis_returns(redis_server: RedisServer) -> None:
    now = [0.0]
    store = RemoteStore(RedisBackend(redis_server.url), fresh_identity(),
                        RemoteConfig(part_bytes=PART), CircuitBreaker(failures_to_open=1, open_s=5, clock=lambda: now[0]))
    redis_server.stop()
    try:
        assert not store.probe()
        assert store.breaker.state == "open"
        now[0] = 4.9
        assert not store.probe() and store.stats().skipped == 1  # still open: not asked
    finally:
        redis_server.start()
    now[0] = 5.0
    assert store.probe()
    assert str(store.breaker.state) == "closed"
    put(store)


def test_breaker_half_open_failure_opens_again() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures_to_open=3, open_s=1, clock=lambda: now[0])
    for _ in range(2):
        breaker.failed()
    assert breaker.state == "closed" and breaker.allow()
    breaker.failed()
    assert (breaker.state, breaker.allow()) == ("open", False)
    now[0] = 1.0
    assert breaker.allow() and str(breaker.state) == "half-open"
    assert not breaker.allow()  # one probe at a time
    breaker.failed()
    assert (breaker.state, breaker.opened) == ("open", 2)


def test_bad_urls_are_value_errors() -> None:
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        open_backend("http://example.com")
    with pytest.raises(ValueError, match="unknown option"):
        open_backend("s3://bucket/p?colour=blue")
    with pytest.raises(ValueError, match="at least 16"):
        RemoteConfig(hmac_key=b"short")


def wait_for(condition: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(0.05)
    return False
