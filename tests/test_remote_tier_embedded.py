"""The remote tier with the embedded model's real KV, replicas in one process on a real Redis:
another replica's state restores exactly; corrupt, truncated, foreign or misnamed remote objects
are misses (counted), never served; a read past its deadline leaves the request to prefill."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference.prompt_cache import ColdRestored, ColdTier
from mlxkv_remote_cache import RedisBackend, RemoteStore
from mlxkv_ssd_cache import KvIdentity, SsdCacheStore
from mlxkv_ssd_cache.layout import entry_id, identity_key
from mlxkv.engine.cache_services import open_cold_tier
from mlxkv.engine.checkpoints import CheckpointStore
from mlxkv.engine.remote_tier import REMOTE, RemoteColdTier, RemoteStatus
from tests.remote_servers import RedisServer, redis_server  # noqa: F401 - fixture

PROMPT = list(range(300, 420))  # 120 tokens
MakeReplica = Callable[..., RemoteColdTier]


def identity(binding: MlxAutoregressiveBinding) -> KvIdentity:
    return KvIdentity(binding.model_id, binding.tokenizer_hash, binding.config_fingerprint)


@pytest.fixture
def make_replica(embedded_native: MlxAutoregressiveBinding, redis_server: RedisServer, tmp_path: Path) -> Iterator[MakeReplica]:
    made: list[RemoteColdTier] = []
    key = "test-" + tmp_path.name[-20:].replace("_", "")  # a fresh shared namespace per test

    def make(name: str, **options: object) -> RemoteColdTier:
        options.setdefault("deadline_s", lambda num_tokens: 120.0)  # a loaded machine's slow read decides nothing here
        store = RemoteStore(RedisBackend(redis_server.url), key)
        tier = RemoteColdTier(open_cold_tier(embedded_native, tmp_path / name, 1 << 30), store, **options)  # type: ignore[arg-type]
        assert tier.mirror.ready.wait(10)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def stored_by(tier: RemoteColdTier, binding: MlxAutoregressiveBinding, tokens: list[int]) -> None:
    caches = binding.make_cache()
    binding.feed(tokens, caches)
    mx.eval([c.state for c in caches])
    assert tier.store(tokens, caches, "")


def states(restored: ColdRestored) -> list[mx.array]:
    return [a for c in restored.caches for a in c.state if isinstance(a, mx.array)]


def restored(tier: RemoteColdTier, prompt: list[int]) -> ColdRestored | None:
    hit = tier.find(prompt, "")
    assert hit is not None and hit.handle.startswith(REMOTE)
    future: Future[ColdRestored | None] = tier.restore_async(hit)
    return future.result(timeout=60)


def seen(tier: RemoteColdTier, tokens: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if tier.find_exact(tokens, "") is not None:
            return True
        time.sleep(0.05)
    return False


def rogue_put(tier: RemoteColdTier, tokens: list[int], data: bytes) -> None:
    """What a buggy or hostile writer can do: any bytes, under the right name, with matching part digests."""
    rogue = RemoteStore(tier.remote.backend, tier.remote.identity_key)
    assert rogue.put_entry("base", entry_id("", tokens), "", tokens, data, 0, True)


def test_tiers_are_cold_tiers_and_checkpoint_stores(make_replica: MakeReplica) -> None:
    tier = make_replica("a")
    cold: ColdTier = tier
    checkpoints: CheckpointStore = tier
    status: RemoteStatus = tier
    assert (cold, checkpoints, status) == (tier, tier, tier)
    assert tier.health() == "ok"


def test_embedded_another_replicas_state_restores_exactly(embedded_native: MlxAutoregressiveBinding, make_replica: MakeReplica) -> None:
    a, b = make_replica("a"), make_replica("b")
    stored_by(a, embedded_native, PROMPT)
    assert seen(b, PROMPT)
    remote_hit, own_hit = b.find(PROMPT + [7], ""), a.find(PROMPT + [7], "")
    assert remote_hit is not None and own_hit is not None
    assert b.restore(remote_hit) is None  # the engine's thread never reads the network
    got = restored(b, PROMPT + [7])
    assert got is not None and got.tokens == tuple(PROMPT)
    own = a.local.restore(own_hit)
    assert own is not None and own.tokens == got.tokens
    assert all(mx.array_equal(x, y) for x, y in zip(states(got), states(own), strict=True))
    assert b.remote_stats()["remote_hits"] == 1
    local = b.find(PROMPT + [7], "")  # now on B's SSD too
    assert local is not None and not local.handle.startswith(REMOTE)


@pytest.mark.parametrize("damage", ["slot byte flipped", "truncated", "foreign identity"])
def test_embedded_bad_remote_objects_are_misses(damage: str, embedded_native: MlxAutoregressiveBinding, make_replica: MakeReplica,
                                                tmp_path: Path) -> None:
    a, b = make_replica("a"), make_replica("b")
    tokens = PROMPT[:100]
    scratch = a.local.ssd
    if damage == "foreign identity":
        other = SsdCacheStore(tmp_path / "other", KvIdentity("another-model", "t", "c"), 1 << 30)
        caches = embedded_native.make_cache()
        embedded_native.feed(tokens, caches)
        assert other.store(tokens, caches, "")
        data = other.file_of("", tokens).read_bytes()
    else:
        caches = embedded_native.make_cache()
        embedded_native.feed(tokens, caches)
        assert scratch.store(tokens, caches, "")  # A's SSD only: nothing shared yet
        data = scratch.file_of("", tokens).read_bytes()
        data = data[:-4096] if damage == "truncated" else data[:-100] + bytes([data[-100] ^ 0x40]) + data[-99:]
    rogue_put(a, tokens, data)
    assert seen(b, tokens)
    assert restored(b, tokens + [1]) is None
    assert b.find(tokens + [1], "") is None  # forgotten: not asked again
    stats = b.remote_stats()
    assert (stats["remote_hits"], stats["remote_misses"], stats["remote_bad_objects"]) == (0, 1, 1)


def test_embedded_a_manifest_naming_other_tokens_is_never_indexed(embedded_native: MlxAutoregressiveBinding, make_replica: MakeReplica) -> None:
    a, b = make_replica("a"), make_replica("b")
    stored_by(a, embedded_native, PROMPT[:50])
    data = a.local.ssd.file_of("", PROMPT[:50]).read_bytes()
    rogue = RemoteStore(a.remote.backend, a.remote.identity_key)
    assert rogue.put_entry("base", entry_id("", PROMPT[:60]), "", PROMPT[:50], data, 0, True)  # name of other tokens
    assert seen(b, PROMPT[:50])
    assert b.find_exact(PROMPT[:60], "") is None
    assert b.remote_stats()["remote_index_entries"] == 1


def test_embedded_read_past_its_deadline_prefills_and_lands_later(embedded_native: MlxAutoregressiveBinding, make_replica: MakeReplica) -> None:
    a = make_replica("a")
    b = make_replica("b", deadline_s=lambda tokens: 0.0)
    stored_by(a, embedded_native, PROMPT)
    assert seen(b, PROMPT)
    assert restored(b, PROMPT + [7]) is None
    assert b.remote_stats()["remote_deadline_misses"] == 1
    deadline = time.monotonic() + 30
    while (hit := b.local.find(PROMPT + [7], "")) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hit is not None and hit.num_tokens == len(PROMPT)  # the late read kept it on B's SSD


def test_identity_key_is_the_ssd_stores(embedded_native: MlxAutoregressiveBinding) -> None:
    assert len(identity_key(identity(embedded_native))) == 32
