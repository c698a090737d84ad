"""Failed SSD writes are never reported durable: retried after demotion, counted when lost, and
answered 503 by POST /admin/cache/flush."""

from __future__ import annotations

import errno
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxkv.engine.cache_services import open_cold_tier
from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference.background_writer import FlushReport
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import compact_copy
from mlxkv_inference.prompt_cache import TieredPromptCache
from mlxkv_inference.prompt_cache.tiered import MAX_WRITE_ATTEMPTS
from mlxkv_serve import ServeConfig, build_app
from tests.factories import make_plain_caches, make_tiny_binding
from tests.test_prompt_cache_tiers import InMemoryColdTier

A = [100] + list(range(15))
B = [200] + list(range(15))


class ScriptedColdTier(InMemoryColdTier):
    """An in-memory cold tier whose n-th store fails when `outcomes[n]` is False (True after them)."""

    def __init__(self, outcomes: Sequence[bool]) -> None:
        super().__init__()
        self.outcomes = list(outcomes)
        self.calls: list[tuple[int, ...]] = []

    def store(self, tokens: Sequence[int], caches: Sequence[LayerCache], ns: str) -> bool:
        self.calls.append(tuple(tokens))
        if self.outcomes and not self.outcomes.pop(0):
            return False
        return super().store(tokens, caches, ns)


def one_entry_tiers(cold: InMemoryColdTier) -> TieredPromptCache:
    one_entry = sum(c.nbytes for c in compact_copy(make_plain_caches(16), 16))  # what the RAM tier keeps of one prompt
    return TieredPromptCache(ram_max_bytes=one_entry, cold=cold)


def test_failed_write_of_an_evicted_entry_is_retried_until_it_lands() -> None:
    cold = ScriptedColdTier([False, False])
    tiers = one_entry_tiers(cold)
    tiers.publish(A, make_plain_caches(16), "")
    assert tiers.flush(10) == FlushReport(settled=True, written=0, failed=1)  # A stays in RAM, not durable
    tiers.publish(B, make_plain_caches(16), "")  # evicts A: its demotion write fails once, then lands
    assert tiers.flush(10) == FlushReport(settled=True, written=2, failed=1)
    assert cold.calls == [tuple(A), tuple(A), tuple(B), tuple(A)]  # the retry waits behind B
    assert set(cold.entries) == {("", tuple(A)), ("", tuple(B))}
    stats = tiers.stats()
    assert (stats.writes_done, stats.writes_failed, stats.entries_lost) == (2, 2, 0)
    assert tiers.fetch(A + [1], "").tier == "ssd"
    tiers.close()


def test_evicted_entry_whose_every_write_fails_is_counted_lost() -> None:
    cold = ScriptedColdTier([False] * 100)
    tiers = one_entry_tiers(cold)
    tiers.publish(A, make_plain_caches(16), "")
    assert tiers.flush(10) == FlushReport(settled=True, written=0, failed=1)
    tiers.publish(B, make_plain_caches(16), "")
    assert tiers.flush(10) == FlushReport(settled=True, written=0, failed=1 + MAX_WRITE_ATTEMPTS)
    assert cold.calls == [tuple(A), tuple(A), tuple(B)] + [tuple(A)] * (MAX_WRITE_ATTEMPTS - 1)
    stats = tiers.stats()
    assert (stats.writes_failed, stats.entries_lost, stats.pending_writes) == (2 + MAX_WRITE_ATTEMPTS, 1, 0)
    tiers.close()


def fill_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(out: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("mlxkv_ssd_cache.kv_file.write_kv_file", no_space)


@pytest.fixture()
def full_disk_server(tmp_path: Path) -> Iterator[tuple[TestClient, TieredPromptCache]]:
    binding: MlxAutoregressiveBinding = make_tiny_binding("llama")
    cold = open_cold_tier(binding, tmp_path, 1 << 30)
    tiers = TieredPromptCache(1 << 30, cold)
    engine = LocalEngine(binding, tiers, ssd=cold)
    config = ServeConfig(vocab_size=binding.tokenizer.vocab_size, flush_timeout_s=30)
    with TestClient(build_app(engine, config), raise_server_exceptions=False) as client:
        yield client, tiers
    engine.close(30)


def test_flush_after_failed_writes_is_503_with_the_count(
    full_disk_server: tuple[TestClient, TieredPromptCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, tiers = full_disk_server
    fill_disk(monkeypatch)
    for first in (1, 2, 3):
        tiers.publish([first] + list(range(15)), make_plain_caches(16), "")
    failed = client.post("/admin/cache/flush")
    assert failed.status_code == 503
    error = failed.json()["error"]
    assert error["code"] == "writes_failed" and error["message"].startswith("3 cache writes failed since the previous flush")
    stats = client.get("/v1/cache/stats").json()
    assert (stats["writes_failed"], stats["writes_done"], stats["ssd_entries"]) == (3, 0, 0)
    assert "mlxkv_cache_entries_lost 0.0" in client.get("/metrics").text
    monkeypatch.undo()  # space again: the next flush reports only what happened since this one
    tiers.publish([4] + list(range(15)), make_plain_caches(16), "")
    flushed = client.post("/admin/cache/flush")
    assert flushed.status_code == 200
    assert (flushed.json()["durable"], flushed.json()["written"], flushed.json()["failed"]) == (True, 1, 0)
