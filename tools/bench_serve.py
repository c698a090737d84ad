"""Continuous batching: aggregate decode tok/s and TTFT p50/p99 with 1, 2, 4 and 8 concurrent
streaming clients, `mlxkv serve --max-batch 8` against `--max-batch 1`, in one run (no prompt
cache, greedy, distinct prompts). Run: `uv run python -m tools.bench_serve`.

`--overhead`: HTTP overhead instead: time to first token and decode tokens/s over `mlxkv serve`
vs in-process, on the same greedy prompts; then 4 concurrent streaming clients.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from mlxkv_inference import GenerationParams, SamplingParams, load_binding
from mlxkv_inference.engine.generate import Generation
from mlxkv_inference.tokenizer.chat import encode_chat
from tests.server_process import ServerProcess

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.", "Describe a walk in the forest."]


def http_run(url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft s, decode tok/s, tokens) of one streamed chat completion."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    return first - start, (tokens - 1) / (last - first), tokens


def in_process_run(binding: object, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    from mlxkv_inference import MlxAutoregressiveBinding

    assert isinstance(binding, MlxAutoregressiveBinding)
    tokens = encode_chat(binding.tokenizer, [{"role": "user", "content": prompt}]).tokens
    generation = Generation(binding, tokens, GenerationParams(max_tokens=max_tokens, sampling=SamplingParams()))
    start = time.perf_counter()
    first = last = 0.0
    for delta in generation:
        if delta.text:
            last = time.perf_counter()
            first = first or last
    assert generation.result is not None
    n = generation.result.generated_tokens
    return first - start, (n - 1) / (last - first), n


STREAM_PROMPTS = PROMPTS + ["List five fruits.", "What is a prime number?", "Say hello in French.", "Name a planet.",
                            "Why is the sky blue?"]
STREAMS = (1, 2, 4, 8)


def concurrent_runs(url: str, streams: int, max_tokens: int) -> tuple[float, list[float]]:
    """(aggregate decode tok/s, TTFTs) of `streams` simultaneous clients (first tokens excluded)."""
    results: list[tuple[float, float, int]] = []
    ends: list[float] = []

    def client(prompt: str) -> None:
        results.append(http_run(url, prompt, max_tokens))
        ends.append(time.perf_counter())

    threads = [threading.Thread(target=client, args=(STREAM_PROMPTS[i],)) for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first_token = start + min(r[0] for r in results)
    decoded = sum(r[2] - 1 for r in results)
    return decoded / (max(ends) - first_token), [r[0] for r in results]


def batching(max_tokens: int) -> None:
    rows: dict[int, list[tuple[float, float, float]]] = {}
    for max_batch in (1, 8):
        server = ServerProcess(Path(tempfile.mkdtemp(prefix="mlxkv-bench-serve-")) / "cache", "--no-ssd-cache",
                               "--prompt-cache-bytes", "0", "--max-batch", str(max_batch))
        try:
            http_run(server.url, "Hi", 2)  # warm-up: compiled step
            for streams in STREAMS:
                tps, ttfts = concurrent_runs(server.url, streams, max_tokens)
                ttfts.sort()
                p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
                rows.setdefault(streams, []).append((tps, statistics.median(ttfts), p99))
        finally:
            server.stop()
    print(f"greedy, {max_tokens} tokens a stream, no prompt cache; aggregate decode tok/s and TTFT p50/p99 (s)")
    print(f"  {'streams':>7} | {'--max-batch 1':^30} | {'--max-batch 8':^30} | {'8 vs 1':>6}")
    for streams, ((tps1, p50a, p99a), (tps8, p50b, p99b)) in rows.items():
        print(f"  {streams:7d} | {tps1:8.2f} t/s {p50a:7.2f} {p99a:7.2f}     | {tps8:8.2f} t/s {p50b:7.2f} {p99b:7.2f}     "
              f"| {tps8 / tps1:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--overhead", action="store_true", help="measure HTTP overhead instead of batching")
    args = parser.parse_args()
    if not args.overhead:
        batching(args.max_tokens)
        return
    binding = load_binding()
    local = [in_process_run(binding, p, args.max_tokens) for p in PROMPTS]
    del binding
    server = ServerProcess(Path(tempfile.mkdtemp(prefix="mlxkv-bench-serve-")) / "cache", "--no-ssd-cache", "--prompt-cache-bytes", "0")
    try:
        http_run(server.url, "Hi", 2)  # warm-up: compiled step
        remote = [http_run(server.url, p, args.max_tokens) for p in PROMPTS]
        results: list[tuple[float, float, int]] = []
        threads = [threading.Thread(target=lambda p=p: results.append(http_run(server.url, p, args.max_tokens)))
                   for p in PROMPTS + PROMPTS[:1]]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        concurrent_s = time.perf_counter() - start
    finally:
        server.stop()
    print(f"{len(PROMPTS)} prompts, greedy, up to {args.max_tokens} tokens; no prompt cache on either side")
    print(f"  {'prompt':6} {'tokens':>6} {'ttft in-proc':>12} {'ttft http':>10} {'decode in-proc':>15} {'decode http':>12}")
    for i, (a, b) in enumerate(zip(local, remote)):
        print(f"  {i:6d} {b[2]:6d} {a[0]:11.3f}s {b[0]:9.3f}s {a[1]:11.2f} t/s {b[1]:8.2f} t/s")
    overhead_ms = 1000 * statistics.median(b[0] - a[0] for a, b in zip(local, remote))
    ratio = statistics.median(b[1] / a[1] for a, b in zip(local, remote))
    print(f"  median TTFT overhead over HTTP: {overhead_ms:.1f} ms; median decode ratio http/in-process: {ratio:.3f}x")
    done = sum(1 for r in results if r[2] > 0)
    print(f"  4 concurrent streaming clients: {done}/4 completed in {concurrent_s:.1f} s, tokens {[r[2] for r in results]}")


if __name__ == "__main__":
    main()
