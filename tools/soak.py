"""Soak: N concurrent clients against a real `mlxkv serve` (started here on a free loopback port
with a temporary cache directory) for a bounded time. Clients mix streaming and non-streaming
chat and completions requests, repeat a few greedy prompts (whose answers must all be equal) and
sometimes leave mid-stream. Prints requests, errors by status, p50/p99 latency of the completed
requests and the server's RSS before and after; exits 1 on any 5xx or on differing greedy answers.

Run (from the repository root): `uv run python -m tools.soak --clients 8 --duration 300 --max-tokens 24`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.server_process import ServerProcess

GREEDY_PROMPTS = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish."]
LEAVE_AFTER_CHUNKS = 2
TIMEOUT_S = 900.0


@dataclass
class Tally:
    """What every client saw; one lock for all of it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    left_mid_stream: int = 0
    greedy: dict[tuple[str, str], set[str]] = field(default_factory=lambda: defaultdict(set))
    greedy_count: Counter[tuple[str, str]] = field(default_factory=Counter)

    def record(self, status: int, latency: float | None, greedy_key: tuple[str, str] | None = None, text: str = "") -> None:
        with self.lock:
            self.statuses[status] += 1
            if latency is not None:
                self.latencies.append(latency)
            if greedy_key is not None and status == 200:
                self.greedy[greedy_key].add(text)
                self.greedy_count[greedy_key] += 1


@dataclass(frozen=True)
class Plan:
    endpoint: str  # "chat" or "completions"
    prompt: str
    greedy: bool
    stream: bool
    leave: bool


def plan(rng: random.Random, client: int, n: int) -> Plan:
    greedy = rng.random() < 0.6
    prompt = rng.choice(GREEDY_PROMPTS) if greedy else f"Client {client}, request {n}: write one line about rivers."
    stream = rng.random() < 0.5
    return Plan(rng.choice(["chat", "completions"]), prompt, greedy, stream, stream and rng.random() < 0.25)


def body(p: Plan, max_tokens: int) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": 0} if p.greedy else {"temperature": 0.8}
    text = {"messages": [{"role": "user", "content": p.prompt}]} if p.endpoint == "chat" else {"prompt": p.prompt}
    return {**text, **sampling, "max_tokens": max_tokens, "stream": p.stream}


def run_one(http: httpx.Client, url: str, p: Plan, max_tokens: int, tally: Tally) -> None:
    path = "/v1/chat/completions" if p.endpoint == "chat" else "/v1/completions"
    key = (p.endpoint, p.prompt) if p.greedy and not p.leave else None
    start = time.perf_counter()
    if not p.stream:
        response = http.post(url + path, json=body(p, max_tokens))
        text = _text(response.json(), p.endpoint, chunk=False) if response.status_code == 200 else ""
        tally.record(response.status_code, time.perf_counter() - start, key, text)
        if response.status_code != 200:
            _note(tally, response.status_code, response.text)
        return
    with http.stream("POST", url + path, json=body(p, max_tokens)) as response:
        if response.status_code != 200:
            response.read()
            tally.record(response.status_code, time.perf_counter() - start)
            _note(tally, response.status_code, response.text)
            return
        parts, chunks, failed = [], 0, ""
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                failed = json.dumps(chunk["error"])
                break
            parts.append(_text(chunk, p.endpoint, chunk=True))
            chunks += 1
            if p.leave and chunks == LEAVE_AFTER_CHUNKS:
                break  # closing the response drops the connection mid-stream
    if failed:  # an error event on a stream is the streaming 500
        tally.record(500, None)
        _note(tally, 500, failed)
    elif p.leave:
        with tally.lock:
            tally.left_mid_stream += 1
            tally.statuses[200] += 1
    else:
        tally.record(200, time.perf_counter() - start, key, "".join(parts))


def client_loop(client: int, url: str, deadline: float, max_tokens: int, tally: Tally) -> None:
    rng = random.Random(client)
    with httpx.Client(timeout=TIMEOUT_S) as http:
        n = 0
        while time.monotonic() < deadline:
            try:
                run_one(http, url, plan(rng, client, n), max_tokens, tally)
            except httpx.HTTPError as e:
                tally.record(-1, None)
                _note(tally, -1, f"{type(e).__name__}: {e}")
            n += 1


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else (values or [0.0])[0]


def report(tally: Tally, clients: int, duration: float, rss: tuple[int, int]) -> int:
    """Print the summary; the exit status (1 on any 5xx, transport error or differing greedy answer)."""
    total = sum(tally.statuses.values())
    print(f"{clients} clients, {duration:.0f} s: {total} requests ({tally.left_mid_stream} left mid-stream)")
    print("by status: " + ", ".join(f"{s if s >= 0 else 'transport error'}: {n}" for s, n in sorted(tally.statuses.items())))
    if tally.latencies:
        print(f"latency of completed requests: p50 {percentile(tally.latencies, 50):.2f} s, "
              f"p99 {percentile(tally.latencies, 99):.2f} s (n={len(tally.latencies)})")
    print(f"server RSS: {rss[0] / 1024:.0f} MiB before, {rss[1] / 1024:.0f} MiB after")
    differing = {k: v for k, v in tally.greedy.items() if len(v) > 1}
    repeated = sum(1 for k in tally.greedy if tally.greedy_count[k] > 1)
    print(f"greedy: {sum(tally.greedy_count.values())} complete answers to {len(tally.greedy)} prompts "
          f"({repeated} asked more than once), {len(differing)} with differing answers")
    for (endpoint, prompt), texts in differing.items():
        print(f"DIFFERENT greedy answers to {endpoint} {prompt!r}: {sorted(texts)!r}")
    for error in tally.errors[:10]:
        print(f"error: {error}")
    bad = any(s >= 500 or s < 0 for s in tally.statuses)
    return 1 if bad or differing else 0


def _text(doc: dict[str, Any], endpoint: str, *, chunk: bool) -> str:
    if not doc.get("choices"):
        return ""
    choice = doc["choices"][0]
    if endpoint == "completions":
        return str(choice.get("text") or "")
    return str((choice["delta"] if chunk else choice["message"]).get("content") or "")


def _note(tally: Tally, status: int, detail: str) -> None:
    with tally.lock:
        tally.errors.append(f"{status}: {detail[:200]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which clients start requests (default 60)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default 16)")
    args = parser.parse_args()
    if args.clients < 1 or args.duration <= 0 or args.max_tokens < 1:
        parser.error("--clients and --max-tokens must be >= 1 and --duration > 0")
    server = ServerProcess(Path(tempfile.mkdtemp(prefix="mlxkv-soak-")) / "cache")
    try:
        before = rss_kib(server.process.pid)
        tally = Tally()
        deadline = time.monotonic() + args.duration
        threads = [threading.Thread(target=client_loop, args=(c, server.url, deadline, args.max_tokens, tally))
                   for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = rss_kib(server.process.pid)
    finally:
        server.stop()
    status = report(tally, args.clients, args.duration, (before, after))
    print(f"server log: {server.log}")
    return status


if __name__ == "__main__":
    sys.exit(main())
