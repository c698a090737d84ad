"""Replicas sharing KV through Redis: time to the first token of turn 2 on replica B after turn 1
ran on replica A (shared tier), against a cold replica and a same-replica SSD hit, at 1k, 4k and
16k prompt tokens; `find` latency with a mirrored index of many entries (against the linear scan
the index replaced); the latency a request path call adds with the backend down once the breaker
is open.

The embedded model's context is 8,192 tokens: rows that do not fit run on the tiny random-weight
64k-context model of tests/agent_model.py (`--model agent`: every row on it); each table says
which model it used.
Run: `uv run python -m tools.bench_remote [--sizes 1024 4096 16384] [--rows find ttft]` (needs
`redis-server`).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from mlxkv_inference.cache.reuse import usable_prefix

from mlxkv.engine.cache_services import SsdColdTier
from mlxkv.engine.remote_tier import RemoteColdTier
from mlxkv_remote_cache import CircuitBreaker, EntryInfo, Manifest, RedisBackend, RemoteStore
from mlxkv_ssd_cache import KvIdentity, SsdCacheStore
from mlxkv_ssd_cache.layout import entry_id
from tests.agent_model import AGENT_CONTEXT, write_agent_model
from tests.remote_servers import RedisServer
from tests.server_process import ServerProcess
from tests.serving import free_port

TURN_2_EXTRA = 32
EMBEDDED_CONTEXT = 8192


def prompt_of(size: int, salt: int) -> list[int]:
    return [1000 + (i * 7919 + salt * 104729) % 40000 for i in range(size)]


def seconds_to_first_token(server: ServerProcess, prompt: list[int]) -> tuple[float, int]:
    started = time.perf_counter()
    response = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=900)
    elapsed = time.perf_counter() - started
    assert response.status_code == 200, response.text
    return elapsed, int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def stats(server: ServerProcess) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(server.url + "/v1/cache/stats", timeout=10).json()
    return found


def ttft_rows(workdir: Path, redis: RedisServer, sizes: list[int], model: list[str]) -> None:
    """The rows of one model (`model`: the `mlxkv serve` arguments that pick it; none: embedded)."""
    for name in ("a", "b", "cold"):
        (workdir / name).mkdir(parents=True)
    a = ServerProcess(workdir / "a" / "cache", "--remote-cache", redis.url, *model)
    b = ServerProcess(workdir / "b" / "cache", "--remote-cache", redis.url, *model)
    cold = ServerProcess(workdir / "cold" / "cache", *model)
    try:
        print(f"{'tokens':>7} {'cold s':>8} {'shared s':>9} {'ssd s':>7} {'cold/shared':>12} {'cold/ssd':>9} "
              "cached(shared, ssd) B's remote (hits, past deadline, misses, breaker opened) B saw A's entry after")
        for salt, size in enumerate(sizes):
            turn_1 = prompt_of(size, salt)
            turn_2 = turn_1 + prompt_of(TURN_2_EXTRA, salt + 100)
            seconds_to_first_token(a, turn_1)
            assert httpx.post(a.url + "/admin/cache/flush", timeout=300).status_code == 200
            seen = stats(b)["remote_index_entries"]
            deadline = time.monotonic() + 30
            waited = time.monotonic()
            while stats(b)["remote_index_entries"] <= seen and time.monotonic() < deadline:
                time.sleep(0.05)
            saw = f"{time.monotonic() - waited:.1f} s" if stats(b)["remote_index_entries"] > seen else "never (30 s)"
            before = stats(b)
            shared, shared_cached = seconds_to_first_token(b, turn_2)
            after = stats(b)
            remote = tuple(after[k] - before[k] for k in ("remote_hits", "remote_deadline_misses", "remote_misses",
                                                          "remote_breaker_opened"))
            cold_s, _ = seconds_to_first_token(cold, turn_2)
            assert httpx.post(b.url + "/admin/cache/flush", timeout=300).status_code == 200
            b.stop()  # RAM gone, B's SSD (where the shared entry was kept) stays
            b = ServerProcess(workdir / "b" / "cache", *model)
            ssd, ssd_cached = seconds_to_first_token(b, turn_2)
            b.stop()
            b = ServerProcess(workdir / "b" / "cache", "--remote-cache", redis.url, *model)
            print(f"{size:>7} {cold_s:>8.2f} {shared:>9.2f} {ssd:>7.2f} {cold_s / shared:>12.1f} {cold_s / ssd:>9.1f} "
                  f"({shared_cached}, {ssd_cached}) {remote} {saw}")
    finally:
        for server in (a, b, cold):
            server.stop()


def find_and_down_rows(workdir: Path, entries: int, tokens: int) -> None:
    identity = KvIdentity("bench", "t", "c")
    local = SsdColdTier(SsdCacheStore(workdir / "ssd", identity, 1 << 30))
    dead = RemoteStore(RedisBackend(f"redis://127.0.0.1:{free_port()}/0"), "bench", breaker=CircuitBreaker(3, 3600))
    tier = RemoteColdTier(local, dead)
    system = prompt_of(tokens // 2, 999)
    for label, prompts in (("distinct prompts", [prompt_of(tokens, 1000 + i) for i in range(entries)]),
                           ("one shared system prompt", [system + prompt_of(tokens // 2, 1000 + i) for i in range(entries)])):
        tier.reset([_record(p) for p in prompts])
        probes = [prompts[(i * 7919) % entries] + [5, 6, 7] for i in range(100)]  # hits
        probes += [prompts[(i * 7919) % entries][: tokens - 10] + [5, 6, 7] for i in range(50)]  # leave mid-entry
        probes += [system + [5, 6, 7] for _ in range(50)]  # only the system prompt in common (or nothing)
        hit = tier.find(probes[0], "")
        assert hit is not None and hit.num_tokens == tokens and _linear_longest(prompts, probes[0]) == tokens
        find_s = _timings(lambda probe: tier.find(probe, ""), probes * 2)
        linear_s = _timings(lambda probe: _linear_longest(prompts, probe), probes[::4])
        print(f"find over {entries} mirrored entries of {tokens} tokens, {label}: p50 {_ms(find_s, 0.5)} ms, "
              f"p99 {_ms(find_s, 0.99)} ms (memory only); the linear scan it replaced: p50 {_ms(linear_s, 0.5)} ms, "
              f"p99 {_ms(linear_s, 0.99)} ms ({statistics.median(linear_s) / statistics.median(find_s):.0f}x)")
    while dead.healthy():  # the mirror's calls open the breaker
        time.sleep(0.05)
    down, local_only = [], []
    for _ in range(1000):
        started = time.perf_counter()
        tier.load_checkpoint("cd" * 32)  # the one remote call on a request's path
        down.append(time.perf_counter() - started)
        started = time.perf_counter()
        local.load_checkpoint("cd" * 32)
        local_only.append(time.perf_counter() - started)
    print(f"checkpoint lookup, backend down, breaker open: median {statistics.median(down) * 1e3:.3f} ms vs SSD alone "
          f"{statistics.median(local_only) * 1e3:.3f} ms (added {(statistics.median(down) - statistics.median(local_only)) * 1e3:.3f} ms)")
    tier.close()


def _record(prompt: list[int]) -> EntryInfo:
    return EntryInfo("base", Manifest("prompt", entry_id("", prompt), "", tuple(prompt), 0, True, 1, (1,), ("0",), None, "ab", 0.0))


def _timings(call: Callable[[list[int]], object], probes: list[list[int]]) -> list[float]:
    timings = []
    for probe in probes:
        started = time.perf_counter()
        call(probe)
        timings.append(time.perf_counter() - started)
    return sorted(timings)


def _ms(sorted_s: list[float], q: float) -> str:
    return f"{sorted_s[min(len(sorted_s) - 1, int(len(sorted_s) * q))] * 1e3:.3f}"


def _linear_longest(prompts: list[list[int]], probe: list[int]) -> int:
    """The scan `PrefixIndex.longest` made before its radix tree (the reference for the ratio)."""
    return max((usable_prefix(p, probe, 0, True) for p in prompts), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--model", choices=["auto", "agent"], default="auto",
                        help="auto: the embedded model where the prompt fits its context, else the tiny agent model")
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--rows", choices=["find", "ttft"], nargs="+", default=["find", "ttft"])
    args = parser.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()} ({_cpu_model()})")
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-remote-") as tmp:
        workdir = Path(tmp)
        if "find" in args.rows:
            find_and_down_rows(workdir, args.entries, 1024)
        if "ttft" not in args.rows:
            return
        redis = RedisServer(workdir)
        try:
            embedded = [n for n in args.sizes if n + TURN_2_EXTRA < EMBEDDED_CONTEXT and args.model == "auto"]
            if embedded:
                print(f"model: embedded SmolLM2-135M-Instruct Q4_1 (context {EMBEDDED_CONTEXT:,})")
                ttft_rows(workdir / "embedded", redis, embedded, [])
            agent = [n for n in args.sizes if n not in embedded]
            if agent:
                print(f"model: tests/agent_model.py (2 layers, hidden 64, random weights, context {AGENT_CONTEXT:,})")
                directory = write_agent_model(workdir / "agent-model")
                ttft_rows(workdir / "agent", redis, agent, ["--model", str(directory)])
        finally:
            redis.stop()


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
