"""The memory budget against what the process really holds: a reading beyond the plan counts,
MLX's buffer cache and the RAM tiers give memory back first, then idle models unload, and what
still does not fit is a 503 naming the numbers; /health shows the figures. Readings are fed by
the test (`FedGauge`) except in the last test, which grows this process's real memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.engine.budgeted import BudgetedEngine
from mlxkv.engine.local_engine import LocalEngine
from mlxkv.engine.measured import PROCESS_MEMORY, MemoryGauge, MemoryReading, MemoryStatus, ProcessMemory, anonymous_rss
from mlxkv.engine.memory import MemoryBudget, RamReleasing, WeightSizes
from mlxkv.engine.models import LoadedModel, ModelPolicy, ModelRouter, ModelSpec
from mlxkv_inference.prompt_cache import RamPromptCache
from mlxkv_inference.prompt_cache.ram_tier import RamEntry
from mlxkv_serve import ServeConfig, build_app
from mlxkv_serve.engine import MemoryReporting
from tests.bindings import GatedBinding
from tests.factories import TINY_VOCAB, make_plain_caches, make_tiny_binding
from tests.gauges import MIB, FedGauge, reading_mib
from tests.serving import running

WAIT_S = 60.0


def complete(url: str, model: str = "x") -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0,
                                                    "speculative": {"mode": "off"}}, timeout=WAIT_S)


def test_the_process_gauge_is_a_memory_gauge_and_reads_this_process() -> None:
    gauge: MemoryGauge = PROCESS_MEMORY
    assert isinstance(gauge, ProcessMemory) and isinstance(FedGauge(reading_mib(1)), MemoryGauge)
    reading = gauge.read()
    assert reading.rss_bytes is not None and reading.rss_bytes > 0  # Linux: /proc/self/statm


def test_anonymous_rss_is_resident_less_file_backed_pages(tmp_path: Path) -> None:
    statm = tmp_path / "statm"
    statm.write_text("5000 300 100 1 0 200 0\n")
    assert anonymous_rss(statm) == 200 * 4096
    statm.write_text("garbage")
    assert anonymous_rss(statm) is None
    assert anonymous_rss(tmp_path / "missing") is None


def test_a_reading_stands_for_the_larger_of_rss_and_mlx_never_their_sum() -> None:
    assert [MemoryReading(10, 3, 2).used_bytes, MemoryReading(4, 3, 2).used_bytes, MemoryReading(None, 3, 2).used_bytes] == [10, 5, 5]
    with pytest.raises(ValueError, match="mlx_cache_bytes=-1 must be >= 0"):
        MemoryReading(1, 0, -1)


def test_measured_memory_counts_only_beyond_the_plan() -> None:
    over = MemoryStatus(100, 60, MemoryReading(90, 0, 0))
    assert (over.unplanned_bytes, over.in_use_bytes, over.fits(10), over.fits(11)) == (30, 90, True, False)
    under = MemoryStatus(100, 60, MemoryReading(50, 0, 0))
    assert (under.unplanned_bytes, under.in_use_bytes, under.fits(40), under.fits(41)) == (0, 60, True, False)
    assert MemoryBudget(100).status(60) == MemoryStatus(100, 60, None)  # no gauge: the plan alone


def test_room_lets_mlxs_cache_go_then_asks_each_ram_tier_for_the_excess_in_turn() -> None:
    gauge = FedGauge(reading_mib(8, active=2, cache=1))
    asked: list[tuple[str, int]] = []

    def nothing_held(nbytes: int) -> int:
        asked.append(("first", nbytes))
        return 0

    def frees_a_mib(nbytes: int) -> int:
        asked.append(("second", nbytes))
        gauge.grow(-MIB)
        return MIB

    def never_asked(nbytes: int) -> int:
        asked.append(("third", nbytes))
        return 0

    status = MemoryBudget(8 * MIB, gauge).room(4 * MIB, 2 * MIB, (nothing_held, frees_a_mib, never_asked))
    # 8 MiB held, 7 once the cache is gone: 1 MiB over for 2 MiB more; 6 MiB once the second tier gave one back
    assert (gauge.releases, asked) == (1, [("first", MIB), ("second", MIB)])
    assert (status.measured_bytes, status.fits(2 * MIB)) == (6 * MIB, True)


def test_room_asks_for_nothing_back_when_the_plan_alone_is_over() -> None:
    gauge = FedGauge(reading_mib(5, cache=1))
    status = MemoryBudget(8 * MIB, gauge).room(7 * MIB, 2 * MIB, (lambda nbytes: pytest.fail("asked for memory back"),))
    assert (gauge.releases, status.in_use_bytes, status.fits(2 * MIB)) == (0, 7 * MIB, False)


def test_the_status_describes_every_figure() -> None:
    status = MemoryStatus(8 * MIB, 4 * MIB, reading_mib(7, active=6))
    assert status.describe() == (
        "the process holds 7.0 MiB (RSS 7.0 MiB, MLX active 6.0 MiB, MLX cache 0.0 MiB), planned 4.0 MiB and 3.0 MiB "
        "beyond the plan, of the memory budget of 8.0 MiB (--memory-budget)")
    assert MemoryStatus(8 * MIB, 4 * MIB, None).describe() == "planned 4.0 MiB of the memory budget of 8.0 MiB (--memory-budget)"


def test_a_ram_tier_releases_its_least_recently_used_entries_to_the_cold_tier() -> None:
    demoted: list[RamEntry] = []
    ram = RamPromptCache(1 << 30, on_evict=demoted.append)
    for i in range(3):
        ram.put([100 + i, *range(15)], make_plain_caches(16), "")
    entry = ram.nbytes // 3
    assert ram.release(entry + 1) == 2 * entry  # whole entries: two to give back a little more than one
    assert [e.tokens[0] for e in demoted] == [100, 101] and ram.nbytes == entry and ram.evictions == 2
    assert ram.release(0) == 0


@pytest.fixture
def tiny_local() -> Iterator[LocalEngine]:
    local = LocalEngine(make_tiny_binding("llama"), None)
    yield local
    local.close(30)


def budgeted(local: LocalEngine, gauge: MemoryGauge, limit: int = 8 * MIB) -> BudgetedEngine:
    # a 4 MiB model whose requests plan 128 KiB a token: "hello" + 4 answer tokens plan 1.125 MiB
    return BudgetedEngine(local, MemoryBudget(limit, gauge), resident=4 * MIB, kv_per_token=128 << 10,
                          context_length=local.context_length)


def test_a_request_the_measured_memory_holds_out_is_a_503_naming_the_numbers(tiny_local: LocalEngine) -> None:
    gauge = FedGauge(reading_mib(8, active=6, cache=1))
    engine = budgeted(tiny_local, gauge)
    assert isinstance(tiny_local, RamReleasing) and isinstance(engine, MemoryReporting)
    with running(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB))) as url:
        refused = complete(url)
        health = httpx.get(url + "/health").json()
        metrics = httpx.get(url + "/metrics").text.splitlines()
    assert (refused.status_code, refused.headers.get("retry-after"), gauge.releases) == (503, "1", 1)
    assert refused.json()["error"]["message"] == (
        "the request's 1.1 MiB of KV does not fit in the memory budget beside what the process holds: the process holds "
        "7.0 MiB (RSS 7.0 MiB, MLX active 6.0 MiB, MLX cache 0.0 MiB), planned 4.0 MiB and 3.0 MiB beyond the plan, of the "
        "memory budget of 8.0 MiB (--memory-budget)")
    assert health["memory"] == {"budget_bytes": 8 * MIB, "planned_bytes": 4 * MIB, "measured_bytes": 7 * MIB,
                                "unplanned_bytes": 3 * MIB, "in_use_bytes": 7 * MIB, "rss_bytes": 7 * MIB,
                                "mlx_active_bytes": 6 * MIB, "mlx_cache_bytes": 0}
    gauges = dict(line.split(" ") for line in metrics if line.startswith("mlxkv_memory_"))
    assert {name: float(value) for name, value in gauges.items()} == {
        f"mlxkv_memory_{name}": float(value) for name, value in health["memory"].items()}


def test_letting_mlxs_buffer_cache_go_admits_the_request(tiny_local: LocalEngine) -> None:
    gauge = FedGauge(reading_mib(8, active=5, cache=2))  # 6 MiB without the cache: 1.125 MiB more fits in 8
    with running(build_app(budgeted(tiny_local, gauge), ServeConfig(vocab_size=TINY_VOCAB))) as url:
        admitted = complete(url)
    assert (admitted.status_code, gauge.releases, gauge.reading) == (200, 1, reading_mib(6, active=5))


def test_a_load_the_measured_memory_holds_out_with_nothing_to_unload_is_a_503_naming_the_numbers() -> None:
    router = ModelRouter([ModelSpec("a", None), ModelSpec("b", None)], lambda spec: pytest.fail("loaded"),
                         ModelPolicy(max_models=2), budget=MemoryBudget(8 * MIB, FedGauge(reading_mib(7.6, cache=0.1))),
                         estimate=lambda spec: MIB)
    try:
        with running(build_app(router, ServeConfig(vocab_size=TINY_VOCAB))) as url:
            refused = complete(url, "a")
    finally:
        router.close(30)
    assert (refused.status_code, refused.headers.get("retry-after")) == (503, "1")
    assert refused.json()["error"]["message"] == (
        "the model 'a' needs about 1.0 MiB (weights and RAM prompt cache) and the memory budget is 8.0 MiB (--memory-budget); "
        "the process holds 7.5 MiB (RSS 7.5 MiB, MLX active 0.0 MiB, MLX cache 0.0 MiB), planned 0.0 MiB and 7.5 MiB beyond "
        "the plan")


def test_a_request_waits_while_a_running_one_holds_memory_and_enters_once_the_process_shrinks() -> None:
    binding = make_tiny_binding("llama", binding_class=GatedBinding)
    assert isinstance(binding, GatedBinding)
    local = LocalEngine(binding, None)
    gauge = FedGauge(reading_mib(5))  # 4 MiB model + 1.125 MiB planned for the first request: it fits
    results: list[int] = []
    try:
        with running(build_app(budgeted(local, gauge), ServeConfig(vocab_size=TINY_VOCAB))) as url:
            clients = [threading.Thread(target=lambda: results.append(complete(url).status_code)) for _ in range(2)]
            clients[0].start()
            assert binding.entered.wait(WAIT_S), "the first request never reached its prefill"
            gauge.grow(2 * MIB)  # 7 MiB held: 1.125 MiB more would pass 8, until the first ends or the process shrinks
            clients[1].start()
            time.sleep(0.3)
            waiting = (local.batch_size() + local.queue_depth(), len(results))
            memory = httpx.get(url + "/health").json()["memory"]
            gauge.grow(-2 * MIB)
            binding.gate.set()
            for client in clients:
                client.join(WAIT_S)
    finally:
        binding.gate.set()
        local.close(30)
    assert waiting == (1, 0)  # the second waited outside the engine
    assert (memory["planned_bytes"], memory["measured_bytes"], memory["in_use_bytes"]) == (
        4 * MIB + 9 * (128 << 10), 7 * MIB, 7 * MIB)
    assert results == [200, 200]


def test_measured_growth_unloads_the_idle_model_that_the_plan_alone_would_keep() -> None:
    gauge = FedGauge(reading_mib(6.5))
    loads: list[str] = []

    def load(spec: ModelSpec) -> LoadedModel:  # each loaded model holds 1 MiB of the process, as planned
        loads.append(spec.name)
        engine = LocalEngine(make_tiny_binding("llama", seed=len(loads)), None)
        gauge.grow(MIB)

        def release(timeout: float) -> None:
            engine.close(timeout)
            gauge.grow(-MIB)
        return LoadedModel(engine, MIB, 1024, engine.context_length, TINY_VOCAB, release)

    # planned: 1 MiB a model, 2 MiB for both, far under 8 MiB; measured: 7.5 MiB with one loaded, 8.5 with both
    router = ModelRouter([ModelSpec("a", None), ModelSpec("b", None)], load, ModelPolicy(max_models=2),
                         budget=MemoryBudget(8 * MIB, gauge), estimate=lambda spec: MIB)
    assert isinstance(router, MemoryReporting)
    try:
        with running(build_app(router, ServeConfig(vocab_size=TINY_VOCAB))) as url:
            answers = [complete(url, "a").status_code, complete(url, "b").status_code]
            states = [(m.name, m.state) for m in router.models()]
            memory = httpx.get(url + "/health").json()["memory"]
    finally:
        router.close(30)
    assert (answers, loads, states) == ([200, 200], ["a", "b"], [("a", "unloaded"), ("b", "loaded")])
    assert (memory["planned_bytes"], memory["measured_bytes"]) == (MIB, int(7.5 * MIB))


def test_real_growth_of_this_process_past_the_budget_is_refused_until_it_is_freed(tiny_local: LocalEngine) -> None:
    gauge = ProcessMemory()
    gauge.release_cache()
    limit = gauge.read().used_bytes + 64 * MIB  # room for the tiny model's requests, not for 160 MiB more
    engine = BudgetedEngine(tiny_local, MemoryBudget(limit, gauge), resident=MIB, kv_per_token=1024,
                            context_length=tiny_local.context_length)
    with running(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB))) as url:
        before = complete(url)
        ballast = np.ones(160 * MIB, dtype=np.uint8)  # every page written: resident
        buffers = [mx.ones((1 << 18,)) + i for i in range(8)]  # MLX's cache holds these once they are dropped
        mx.eval(buffers)
        del buffers
        assert mx.get_cache_memory() > 0
        refused = complete(url)
        cache_after = mx.get_cache_memory()
        memory = httpx.get(url + "/health").json()["memory"]
        del ballast
        after = complete(url)
    assert (before.status_code, refused.status_code, after.status_code) == (200, 503, 200)
    message = refused.json()["error"]["message"]
    assert message.startswith("the request's ") and "of KV does not fit in the memory budget beside what the process holds: " in message
    assert f"of the memory budget of {limit / MIB:,.1f} MiB (--memory-budget)" in message
    assert cache_after == 0  # let go before the refusal
    assert memory["budget_bytes"] == limit and memory["rss_bytes"] > limit and memory["planned_bytes"] == MIB
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]


def test_a_model_is_planned_at_its_files_bytes_until_it_loads_then_at_what_its_parameters_held(tmp_path: Path) -> None:
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"\0" * 4096)
    sizes = WeightSizes()
    assert sizes.planned("gemma", weights) == 4096
    sizes.loaded("gemma", 6000)  # widened on load
    assert sizes.planned("gemma", weights) == 6000  # its next load (after an unload) plans what it held
    assert sizes.planned("other", weights) == 4096
    sizes.loaded("other", 1000)  # held less than its file: the file still bounds the load's read
    assert sizes.planned("other", weights) == 4096
