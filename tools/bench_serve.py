"""Continuous batching: aggregate decode tok/s and TTFT p50/p99 with 1, 2, 4 and 8 concurrent
streaming clients, in one run, on `mlxkv serve --max-batch 8`, on `--max-batch 1`, and on
mlx_lm.server (mlx-lm's own batching) over the same weights: the embedded model written out as an
mlx-lm directory (`tools.mlx_lm_reference`). The servers run side by side and take turns: each
concurrency runs `--rounds` times on every server in turn, so a slower or faster minute of a shared
machine (a lone stream here varies 1.5x between minutes) falls on all of them alike; a column's
tok/s is the median of its rounds, its TTFT p50/p99 over all of them, and "8 vs 1" is the median
of the rounds' own ratios. No prompt cache on any server, greedy (or
`--temperature T [--top-p P]`: sampled requests, the same fields on every server), distinct
prompts; the mlxkv servers run the CLI's default CPU kernels (native where built). Every stream's
EOS is barred (`logit_bias`, on every server), so each runs its max tokens and N streams stay N
concurrent sequences to the end (most of these prompts' answers end within 20-30 tokens, leaving a
batch of two or three); `--stop-at-eos` lets answers end.

Then TTFT under a long prefill, on the `--max-batch 8` server: a short request's TTFT on the idle
server against the p99 TTFT of short requests arriving while a 2,000-token prompt prefills, and
that long prompt's time to first token against one's on the idle server (the faster of two; what the
shorts cost it).
Run: `uv run python -m tools.bench_serve [--max-tokens N] [--streams 1,2,4,8] [--rounds 3] [--long-prompt 2000]`;
`--long-only` runs only the long-prefill measurement.

`--overhead`: HTTP overhead instead: time to first token and decode tokens/s over `mlxkv serve`
vs in-process, on the same greedy prompts; then 4 concurrent streaming clients.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from mlxkv_inference import GenerationParams, SamplingParams, load_binding
from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.native.kernels import default_cpu_kernels
from mlxkv_inference.tokenizer.chat import encode_chat
from tests.server_process import ServerProcess
from tools.mlx_lm_reference import MlxLmServer, write_mlx_lm_directory

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.", "Describe a walk in the forest."]


def http_run(url: str, prompt: str, max_tokens: int, fields: dict[str, Any] | None = None) -> tuple[float, float, int]:
    """(ttft s, decode tok/s, tokens) of one streamed chat completion (greedy unless `fields`, more
    request fields such as logit_bias, temperature and top_p, say otherwise)."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                            **(fields or {})}
    ttft, decode_s, tokens = timed_stream(url, "/v1/chat/completions", body)
    return ttft, (tokens - 1) / decode_s if decode_s > 0 else 0.0, tokens


@functools.cache
def shared_client() -> httpx.Client:
    """One keep-alive client for every request, as an SDK client is: a fresh httpx client costs
    ~15-45 ms here (its SSL context, even for http), which would count in every TTFT."""
    return httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


def timed_stream(url: str, path: str, body: dict[str, Any]) -> tuple[float, float, int]:
    """(seconds to the first text, seconds from the first text to the last, completion tokens) of one
    streamed OpenAI chat or text completion."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with shared_client().stream("POST", url + path, json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and (chunk["choices"][0].get("text") or chunk["choices"][0].get("delta", {}).get("content")):
                last = time.perf_counter()
                first = first or last
    return first - start, last - first, tokens


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


def concurrent_runs(url: str, streams: int, max_tokens: int,
                    fields: dict[str, Any] | None = None) -> tuple[float, list[float]]:
    """(aggregate decode tok/s, TTFTs) of `streams` simultaneous clients (first tokens excluded)."""
    results: list[tuple[float, float, int]] = []
    ends: list[float] = []

    def client(prompt: str) -> None:
        results.append(http_run(url, prompt, max_tokens, fields))
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


Row = tuple[float, float, float]  # aggregate decode tok/s, TTFT p50 s, TTFT p99 s


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (with fewer than 100 values, p99 is the largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


def interleaved_runs(urls: dict[str, str], streams: Sequence[int], max_tokens: int, rounds: int,
                     fields: dict[str, Any] | None = None) -> dict[str, dict[int, tuple[list[float], list[float]]]]:
    """Per server, per concurrency: (aggregate tok/s of each round, every round's TTFTs); each
    round runs the concurrency on every server in turn."""
    for url in urls.values():
        http_run(url, "Hi", 2)  # warm-up: compiled step, first-use allocations
    runs: dict[str, dict[int, tuple[list[float], list[float]]]] = {name: {n: ([], []) for n in streams} for name in urls}
    for n in streams:
        for _ in range(rounds):
            for name, url in urls.items():
                tps, ttfts = concurrent_runs(url, n, max_tokens, fields)
                runs[name][n][0].append(tps)
                runs[name][n][1].extend(ttfts)
    return runs


def row(tps: list[float], ttfts: list[float]) -> Row:
    return statistics.median(tps), statistics.median(ttfts), percentile(ttfts, 0.99)


def paired_ratio(mine: list[float], theirs: list[float]) -> float:
    """The median of the rounds' ratios (each round's runs minutes apart at most)."""
    return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))


@contextmanager
def mlxkv_server(*extra: str) -> Iterator[ServerProcess]:
    """`mlxkv serve` with the CLI's defaults (native CPU kernels where built) but `extra`, no prompt cache."""
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-serve-") as scratch:  # its log goes with it
        server = ServerProcess(Path(scratch) / "cache", "--no-ssd-cache", "--prompt-cache-bytes", "0", *extra)
        try:
            yield server
        finally:
            server.stop()


@contextmanager
def mlx_lm_server() -> Iterator[MlxLmServer]:
    """mlx_lm.server on the embedded model written out as an mlx-lm directory."""
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-mlx-lm-") as scratch:
        server = MlxLmServer(write_mlx_lm_directory(Path(scratch) / "SmolLM2-135M-Instruct-Q4_1"))
        try:
            yield server
        finally:
            server.stop()


def batching(args: argparse.Namespace) -> None:
    max_tokens, streams, long_prompt = args.max_tokens, [int(n) for n in args.streams.split(",")], args.long_prompt
    extra = server_options(args)
    if args.long_only:
        long_prefill_only(long_prompt, args.long_rounds, extra)
        return
    bias = None if args.stop_at_eos else no_eos()
    fields: dict[str, Any] = {"temperature": args.temperature, **({"top_p": args.top_p} if args.top_p < 1 else {}),
                              **({"logit_bias": bias} if bias else {})}
    with contextlib.ExitStack() as stack:
        urls = {"--max-batch 1": stack.enter_context(mlxkv_server("--max-batch", "1", *extra)).url,
                "--max-batch 8": stack.enter_context(mlxkv_server("--max-batch", "8", *extra)).url}
        if args.reference:
            urls["mlx_lm.server"] = stack.enter_context(mlx_lm_server()).url
        health = httpx.get(urls["--max-batch 8"] + "/health", timeout=30).json()
        runs = interleaved_runs(urls, streams, max_tokens, args.rounds, fields)
        prefill = long_prefill(urls["--max-batch 8"], long_prompt, args.long_rounds) if long_prompt else None
    ending = "answers end at EOS" if bias is None else "EOS barred"
    sampling = "greedy" if not args.temperature else f"temperature {args.temperature}" + (
        f", top_p {args.top_p}" if args.top_p < 1 else "")
    print(f"{sampling}, {max_tokens} tokens a stream ({ending}), no prompt cache, {args.rounds} rounds taking turns; "
          f"mlxkv cpu kernels {health['cpu_kernels']}, BLAS {health['blas']}; aggregate decode tok/s and TTFT p50/p99 (s)")
    print("  " + f"{'streams':>7} | " + " | ".join(f"{name:^29}" for name in urls)
          + " | 8 vs 1 (rounds)" + (" | mlxkv/mlx_lm: tok/s, TTFT p50" if args.reference else ""))
    for n in streams:
        rows = {name: row(*runs[name][n]) for name in urls}
        cells = " | ".join(f"{tps:8.2f} t/s {p50:7.2f} {p99:7.2f}  " for tps, p50, p99 in rows.values())
        batched, alone = runs["--max-batch 8"][n][0], runs["--max-batch 1"][n][0]
        each = ", ".join(f"{a / b:.2f}" for a, b in zip(batched, alone))
        line = f"  {n:7d} | {cells} | {paired_ratio(batched, alone):5.2f}x ({each})"
        if args.reference:
            line += (f" | {paired_ratio(batched, runs['mlx_lm.server'][n][0]):5.2f}x"
                     f"  {rows['--max-batch 8'][1] / rows['mlx_lm.server'][1]:5.2f}x")
        print(line)
    if prefill is not None:
        print_long_prefill(long_prompt, *prefill)
    if extra:
        print(f"(mlxkv servers ran with {' '.join(extra)})")


def no_eos() -> dict[str, float]:
    """A logit_bias that bars the embedded model's end-of-sequence tokens."""
    return {str(token): -100.0 for token in load_binding(cpu_kernels="mlx").eos_token_ids}


def server_options(args: argparse.Namespace) -> tuple[str, ...]:
    """The mlxkv servers' prefill and speculation options the command line sets (the CLI's defaults otherwise)."""
    extra: tuple[str, ...] = ()
    if args.prefill_step_size:
        extra += ("--prefill-step-size", str(args.prefill_step_size))
    if args.prefill_step_ms is not None:
        extra += ("--prefill-step-ms", str(args.prefill_step_ms))
    if args.speculative is not None:
        extra += ("--speculative", args.speculative)
    return extra


def long_prefill_only(long_prompt: int, rounds: int, extra: Sequence[str]) -> None:
    """The TTFT-under-long-prefill measurement alone, on one `--max-batch 8` server."""
    with mlxkv_server("--max-batch", "8", *extra) as server:
        http_run(server.url, "Hi", 2)  # warm-up: compiled step, first-use allocations
        prefill = long_prefill(server.url, long_prompt, rounds)
    print_long_prefill(long_prompt, *prefill)
    if extra:
        print(f"(the mlxkv server ran with {' '.join(extra)})")


SHORT_PROMPT = "Say hello in French."
IDLE_SAMPLES = 15
LONG_TOKEN_BASE = 1000  # long prompts are token ids of ordinary words in the embedded vocabulary, none a special
LONG_TOKEN_SPAN = 8000


def long_prefill(url: str, prompt_tokens: int, rounds: int) -> tuple[list[float], list[float], list[float], float]:
    """(TTFTs of a short request on the idle server; TTFTs of short requests sent one after another
    while a `prompt_tokens`-token prompt prefills, over `rounds` long prompts; seconds each long
    prompt took to its first token; seconds one took on the idle server)."""
    idle = [timed_stream(url, "/v1/chat/completions", short_body())[0] for _ in range(IDLE_SAMPLES)]
    # The faster of two on the idle server (the first long prompt also pays first-use costs);
    # rounds past the timed ones, so no prompt repeats.
    long_idle = min(timed_stream(url, "/v1/completions", long_body(prompt_tokens, rounds + i))[0] for i in range(2))
    busy: list[float] = []
    long_ttfts: list[float] = []
    for round_ in range(rounds):
        long_ttfts.append(shorts_during(url, long_body(prompt_tokens, round_), statistics.median(idle), busy))
    return idle, busy, long_ttfts, long_idle


def long_body(prompt_tokens: int, round_: int) -> dict[str, Any]:
    tokens = [LONG_TOKEN_BASE + (7 * round_ + i) % LONG_TOKEN_SPAN for i in range(prompt_tokens)]
    return {"prompt": tokens, "max_tokens": 1, "temperature": 0}


def shorts_during(url: str, long_request_body: dict[str, Any], idle_ttft: float, busy: list[float]) -> float:
    """Send short requests one after another while `long_request_body` prefills, adding to `busy`
    the TTFT of each that arrived before the long prompt's first token; returns the long prompt's
    TTFT."""
    long_first: list[float] = []  # when the long prompt's first token came
    long_ttft: list[float] = []

    def long_request() -> None:
        begun = time.perf_counter()
        long_ttft.append(timed_stream(url, "/v1/completions", long_request_body)[0])
        long_first.append(begun + long_ttft[0])

    thread = threading.Thread(target=long_request)
    thread.start()
    while thread.is_alive() and not re.search(r"^mlxkv_batch_size [1-9]", httpx.get(url + "/metrics").text, re.M):
        time.sleep(0.01)  # until the long prompt is admitted: it is prefilling
    sent = 0
    while thread.is_alive():
        time.sleep(idle_ttft * (sent % 4) / 4)  # arrive at varied points of a prefill chunk
        sent += 1
        arrival = time.perf_counter()
        ttft = timed_stream(url, "/v1/chat/completions", short_body())[0]
        if not long_first or arrival < long_first[0]:
            busy.append(ttft)
    thread.join()
    return long_ttft[0]


def short_body() -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": SHORT_PROMPT}], "max_tokens": 2, "temperature": 0}


def print_long_prefill(prompt_tokens: int, idle: list[float], busy: list[float], long_ttfts: list[float],
                       long_idle: float) -> None:
    idle_ttft = statistics.median(idle)
    print(f"TTFT of a short request ({SHORT_PROMPT!r}) on the idle --max-batch 8 server, median of {len(idle)}: "
          f"{idle_ttft:.3f} s")
    if not busy:
        print(f"  no short request arrived during the {prompt_tokens}-token prefill")
        return
    p99 = percentile(busy, 0.99)
    print(f"  {len(long_ttfts)} {prompt_tokens}-token prompts, TTFT median {statistics.median(long_ttfts):.2f} s "
          f"({statistics.median(long_ttfts) / long_idle:.2f}x one on the idle server, {long_idle:.2f} s); "
          f"{len(busy)} short requests arriving during their prefill: TTFT p50 {statistics.median(busy):.3f} s, "
          f"p99 {p99:.3f} s; p99 / idle = {p99 / idle_ttft:.2f}x (target <= 2x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", default=",".join(map(str, STREAMS)), help="concurrencies, comma-separated (default: 1,2,4,8)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of each concurrency, the servers taking turns (default: 3)")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="let answers end at EOS (default: bar it, so every stream runs --max-tokens)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the streams' temperature (default: 0, greedy); unseeded, each server picks its seeds")
    parser.add_argument("--top-p", type=float, default=1.0, help="the streams' top_p (default: 1, off)")
    parser.add_argument("--no-mlx-lm", dest="reference", action="store_false", help="skip the mlx_lm.server reference row")
    parser.add_argument("--long-prompt", type=int, default=2000, metavar="TOKENS",
                        help="prompt length for the TTFT-under-long-prefill measurement (default: 2000; 0 skips it)")
    parser.add_argument("--long-rounds", type=int, default=3, metavar="N", help="long prompts to send short requests under (default: 3)")
    parser.add_argument("--prefill-step-size", type=int, default=0, metavar="N",
                        help="the mlxkv servers' --prefill-step-size (default: the CLI's)")
    parser.add_argument("--prefill-step-ms", type=float, default=None, metavar="MS",
                        help="the mlxkv servers' --prefill-step-ms (default: the CLI's)")
    parser.add_argument("--speculative", choices=("off", "prompt_lookup"), default=None,
                        help="the mlxkv servers' --speculative (default: the CLI's)")
    parser.add_argument("--long-only", action="store_true",
                        help="only the TTFT-under-long-prefill measurement (no streams table, one server)")
    parser.add_argument("--overhead", action="store_true", help="measure HTTP overhead instead of batching")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, not {args.rounds}")
    if not args.overhead:
        batching(args)
        return
    binding = load_binding(cpu_kernels=default_cpu_kernels())  # the kernels `mlxkv serve` runs by default
    local = [in_process_run(binding, p, args.max_tokens) for p in PROMPTS]
    del binding
    with mlxkv_server() as server:
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
