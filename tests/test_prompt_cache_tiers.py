"""The tiered prompt cache: RAM tier rules, the cold tier contract, demotion and namespaces."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxkv.engine.cache_services import SsdColdTier, open_cold_tier
from mlxkv_inference import Generation, GenerationParams, KvScheme
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.cache.reuse import clone_trimmed, usable_prefix, all_trimmable, minimum_reusable_offset
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.prompt_cache import ColdHit, ColdRestored, ColdTier, RamPromptCache, TieredPromptCache
from tests.factories import make_plain_caches, make_prompt, make_tiny_binding


class InMemoryColdTier:
    """A cold tier in a dict: the same contract as the SSD one, for testing the RAM side alone."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, tuple[int, ...]], list[LayerCache]] = {}
        self.stores = 0

    def find(self, prompt: Sequence[int], ns: str) -> ColdHit | None:
        best: ColdHit | None = None
        for (entry_ns, tokens), caches in self.entries.items():
            usable = usable_prefix(tokens, prompt, minimum_reusable_offset(caches), all_trimmable(caches))
            if entry_ns == ns and usable and (best is None or usable > best.num_tokens):
                best = ColdHit(repr(tokens), ns, usable, len(tokens))
        return best

    def find_exact(self, tokens: Sequence[int], ns: str) -> ColdHit | None:
        key = (ns, tuple(tokens))
        return ColdHit(repr(key[1]), ns, len(tokens), len(tokens)) if key in self.entries else None

    def restore(self, hit: ColdHit) -> ColdRestored | None:
        tokens = tuple(eval(hit.handle))  # noqa: S307 - the handle is our own repr of a tuple of ints
        caches = self.entries.get((hit.ns, tokens))
        return None if caches is None else ColdRestored(clone_trimmed(caches, hit.num_tokens), tokens[: hit.num_tokens])

    def restore_async(self, hit: ColdHit) -> Future[ColdRestored | None]:
        future: Future[ColdRestored | None] = Future()
        future.set_result(self.restore(hit))
        return future

    def store(self, tokens: Sequence[int], caches: Sequence[LayerCache], ns: str) -> bool:
        self.entries[(ns, tuple(tokens))] = clone_trimmed(caches, len(tokens))
        self.stores += 1
        return True


def test_take_is_non_consuming_and_copies_are_independent() -> None:
    ram = RamPromptCache(1 << 30)
    ram.put(list(range(20)), clone_trimmed(make_plain_caches(20), 20), "")
    first = ram.take(list(range(20)) + [7], "")
    second = ram.take(list(range(12)) + [9], "")
    assert first is not None and second is not None
    assert (first.num_tokens, second.num_tokens) == (20, 12)
    assert [c.offset for c in second.caches] == [12, 12]
    # Write token 12 into the second copy: that position holds token 12 of the entry and of the
    # first copy, so a shared buffer written in place would show up in both.
    written = second.caches[0]
    assert isinstance(written, PlainKVCache)
    written.update_and_fetch(mx.ones((1, 2, 1, 32)), mx.ones((1, 2, 1, 32)))
    third = ram.take(list(range(20)) + [7], "")
    assert third is not None and third.num_tokens == 20 and len(ram) == 1
    original = make_plain_caches(20)[0]
    assert original.keys is not None and original.values is not None
    for copy in (first.caches[0], third.caches[0]):
        assert isinstance(copy, PlainKVCache) and copy.keys is not None and copy.values is not None
        assert copy.offset == 20
        assert mx.array_equal(copy.keys[..., :20, :], original.keys[..., :20, :]).item()
        assert mx.array_equal(copy.values[..., :20, :], original.values[..., :20, :]).item()
    assert written.keys is not None and mx.array_equal(written.keys[..., 12, :], mx.ones((1, 2, 32))).item()


def test_namespaces_never_share_entries_in_ram() -> None:
    ram = RamPromptCache(1 << 30)
    ram.put(list(range(20)), clone_trimmed(make_plain_caches(20), 20), "adapter-a")
    assert ram.take(list(range(21)), "adapter-b") is None
    assert ram.take(list(range(21)), "") is None
    assert ram.take(list(range(21)), "adapter-a") is not None


def test_a_cache_with_no_room_anywhere_copies_nothing_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RAM bytes and no cold tier (`--prompt-cache-bytes 0 --no-ssd-cache`): a published state is
    dropped without the copy that would block the worker (~45 ms for 2,000 tokens here)."""
    import mlxkv_inference.prompt_cache.tiered as tiered

    def refused(*_: Any) -> None:
        raise AssertionError("copied a state nothing keeps")

    monkeypatch.setattr(tiered, "frozen_copy", refused)
    tiers = TieredPromptCache(ram_max_bytes=0)
    tiers.publish(list(range(16)), make_plain_caches(16), "")
    assert tiers.stats().ram_entries == 0 and tiers.fetch(list(range(17)), "").caches is None


def test_byte_cap_evicts_least_recently_used_and_demotes_to_the_cold_tier() -> None:
    entry = 16 * sum(c.bytes_per_token() for c in make_plain_caches(16))  # what a kept entry holds
    cold = InMemoryColdTier()
    tiers = TieredPromptCache(ram_max_bytes=2 * entry, cold=cold)
    for i in range(3):
        tiers.publish([100 + i] + list(range(15)), make_plain_caches(16), "")
    assert tiers.flush(10).durable
    stats = tiers.stats()
    assert stats.ram_bytes <= 2 * entry and stats.ram_entries == 2 and stats.ram_evictions == 1
    assert len(cold.entries) == 3  # every published state was written behind
    fetched = tiers.fetch([100] + list(range(15)) + [5], "")
    assert (fetched.tier, fetched.num_tokens) == ("ssd", 16)  # evicted from RAM, restored from cold
    assert tiers.fetch([100] + list(range(15)) + [5], "").tier == "ram"  # republished
    tiers.close()


def test_cold_tier_wins_only_with_a_strictly_longer_prefix() -> None:
    cold = InMemoryColdTier()
    tiers = TieredPromptCache(ram_max_bytes=1 << 30, cold=cold)
    cold.store(list(range(30)), make_plain_caches(30), "")
    tiers.publish(list(range(20)), make_plain_caches(20), "")
    assert tiers.flush(10).durable
    cold.store(list(range(20)), make_plain_caches(20), "")
    assert tiers.fetch(list(range(20)) + [1], "").tier == "ram"  # equal length: RAM
    fetched = tiers.fetch(list(range(30)) + [1], "")
    assert (fetched.tier, fetched.num_tokens) == ("ssd", 30)
    assert tiers.stats().ram_hits == 1 and tiers.stats().ssd_hits == 1
    tiers.close()


def test_two_model_identities_never_share_an_entry(tmp_path: Path) -> None:
    first, second = make_tiny_binding("llama", seed=0), make_tiny_binding("llama", seed=1)
    cold_a = open_cold_tier(first, tmp_path, 1 << 30)
    assert cold_a.store(list(range(12)), make_plain_caches(12), "")
    cold_b = open_cold_tier(second, tmp_path, 1 << 30)
    assert cold_b.find(list(range(13)), "") is None
    assert cold_a.find(list(range(13)), "") is not None


def test_ssd_cold_tier_implements_the_protocol(tmp_path: Path) -> None:
    binding = make_tiny_binding("llama")
    ssd = open_cold_tier(binding, tmp_path, 1 << 30)
    cold: ColdTier = ssd
    tokens = list(range(24))
    assert cold.store(tokens, make_plain_caches(24), "")
    hit = cold.find(tokens + [1], "")
    assert hit is not None and hit.num_tokens == 24
    exact = cold.find_exact(tokens, "")
    assert exact is not None and exact.entry_tokens == 24
    restored = cold.restore(hit)
    assert restored is not None and restored.tokens == tuple(tokens)
    later = cold.restore_async(cold.find(list(range(10)) + [99], "") or hit).result(timeout=30)
    assert later is not None and [c.offset for c in later.caches] == [10, 10]
    assert isinstance(ssd, SsdColdTier)


def test_ram_entry_accounts_exactly_the_bytes_its_tokens_need() -> None:
    caches = make_plain_caches(20)  # 256-token buffers holding 20 tokens
    per_token = sum(c.bytes_per_token() for c in caches)
    assert per_token == 2 * 2 * (2 * 32 * 4)  # layers x (keys, values) x (heads x dims x float32)
    mx.eval(mx.zeros(1))
    baseline = mx.get_active_memory()
    ram = RamPromptCache(1 << 30)
    assert ram.put(list(range(20)), caches, "")
    del caches
    (entry,) = ram.entries()
    assert entry.nbytes == ram.nbytes == 20 * per_token
    assert [c.keys.shape[2] for c in entry.caches if isinstance(c, PlainKVCache) and c.keys is not None] == [20, 20]
    # The entry does not keep the 256-token buffers alive through a view.
    assert mx.get_active_memory() - baseline < 256 * per_token


@pytest.mark.parametrize("kind,scheme", [("llama", KvScheme()), ("llama", KvScheme(bits=8, group_size=32, quantized_start=4)),
                                         ("gemma3_text", KvScheme()), ("qwen3_next", KvScheme())])
def test_ram_hit_continues_exactly_like_a_cold_run(kind: str, scheme: KvScheme) -> None:
    overrides: dict[str, Any] = {"head_dim": 64} if scheme.bits else {}
    binding = make_tiny_binding(kind, kv_scheme=scheme, **overrides)
    tiers = TieredPromptCache(ram_max_bytes=1 << 30)
    generator = CachedGenerator(binding, tiers)
    params = GenerationParams(max_tokens=12, ignore_eos=True)
    first_prompt = make_prompt(7, seed=3)
    first = generator.start(first_prompt, params)
    first_tokens = list(first.run().token_ids)
    generator.settle(first)
    prompt = first_prompt + first_tokens + make_prompt(5, seed=4)
    warm = generator.start(prompt, params)
    warm_result = warm.run()
    assert warm_result.cached_tokens == len(first_prompt) + len(first_tokens) - 1  # all but the unfed last token
    assert warm_result.token_ids == Generation(binding, prompt, params).run().token_ids


def test_ram_tier_breaks_ties_toward_the_most_recently_used_entry() -> None:
    ram = RamPromptCache(1 << 30)
    ram.put([1, 2, 3, 10], make_plain_caches(4, seed=1), "")
    ram.put([1, 2, 3, 20], make_plain_caches(4, seed=2), "")

    def tied_source() -> int:
        """Which entry (by its seed) a prompt sharing 3 tokens with both is served from."""
        taken = ram.take([1, 2, 3, 99, 5], "")
        assert taken is not None and taken.num_tokens == 3
        got = taken.caches[0]
        assert isinstance(got, PlainKVCache) and got.keys is not None
        for seed in (1, 2):
            want = make_plain_caches(4, seed=seed)[0].keys
            if want is not None and mx.array_equal(got.keys[..., :3, :], want[..., :3, :]).item():
                return seed
        raise AssertionError("served from neither entry")

    assert tied_source() == 2
    assert ram.take([1, 2, 3, 10, 7], "") is not None  # uses (and refreshes) the first entry
    assert tied_source() == 1
