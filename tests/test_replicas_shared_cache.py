"""Acceptance: two `mlxkv serve` replicas (embedded model, their own --ssd-cache each) on one
shared tier, real Redis or real SeaweedFS (S3) on loopback.

Turn 1 on A, turn 2 on B: B restores A's KV and answers exactly what one replica answers. Redis
killed mid-request: served cold, no 5xx, /health "degraded", the flush reports the copies that
failed (503), and back to "ok" once Redis returns.
A killed (-9) mid-generation: the client's retry on B resumes from A's checkpoint, exactly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxkv_inference import MlxAutoregressiveBinding, SamplingParams
from tests.remote_servers import RedisServer, SeaweedS3, redis_server, seaweed_s3  # noqa: F401 - fixtures
from tests.server_process import ServerProcess
from tests.test_resume_after_kill import CHECKPOINT_EVERY, DURABLE_AT, KILL_AFTER, MAX_TOKENS, PROMPT, complete, stream_until_killed, uninterrupted

SYSTEM = ("You are a patient assistant for a small bakery. Answer in one short paragraph. The bakery opens at seven, "
          "closes at six, sells sourdough, rye and spelt loaves, croissants on weekends only, and takes orders by "
          "phone a day ahead. Prices: sourdough four euros, rye three fifty, spelt four fifty, croissants one eighty. "
          "Never invent products, never promise delivery, and always remind the customer to bring a bag. ") * 3
TURN_1 = "What bread do you sell?"
TURN_2 = "And when are you open?"


def chat(server: ServerProcess, messages: list[dict[str, str]]) -> dict[str, Any]:
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 24,
                                                                     "temperature": 0}, timeout=600)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def flush(server: ServerProcess) -> None:
    response = httpx.post(server.url + "/admin/cache/flush", timeout=120)
    assert response.status_code == 200, response.text


def lookup(server: ServerProcess, messages: list[dict[str, str]]) -> dict[str, Any]:
    response = httpx.post(server.url + "/v1/cache/lookup", json={"messages": messages}, timeout=60)
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


def stats(server: ServerProcess) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(server.url + "/v1/cache/stats", timeout=10).json()
    return found


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout} s")


@pytest.fixture(params=["redis", "s3"])
def shared_url(request: pytest.FixtureRequest) -> str:
    server: RedisServer | SeaweedS3 = request.getfixturevalue("redis_server" if request.param == "redis" else "seaweed_s3")
    return server.url


def replica(tmp_path: Path, name: str, url: str, *extra: str) -> ServerProcess:
    return ServerProcess(tmp_path / name / "cache", "--remote-cache", url, *extra)


@pytest.fixture
def replicas(tmp_path: Path, shared_url: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = replica(tmp_path, "a", shared_url)
    b = replica(tmp_path, "b", shared_url)
    yield a, b
    a.stop()
    b.stop()


def test_embedded_turn_two_on_another_replica_reuses_turn_one(replicas: tuple[ServerProcess, ServerProcess]) -> None:
    a, b = replicas
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURN_1}]
    first = chat(a, history)
    shared = first["usage"]["prompt_tokens"]
    flush(a)
    wait_until(lambda: stats(b)["remote_index_entries"] >= 1, 30, "B never saw A's entry")
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}, {"role": "user", "content": TURN_2}]
    before = lookup(b, history)  # what a router asks: B holds the prefix through the shared tier
    second = chat(b, history)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.95 * shared
    assert stats(b)["remote_hits"] == 1
    assert (before["prompt_tokens"], before["cached_tokens"], before["tier"]) == (second["usage"]["prompt_tokens"], cached, "remote")
    assert lookup(b, history)["tier"] == "ram"
    unrelated = httpx.post(b.url + "/v1/cache/lookup", json={"prompt": "Unrelated text, no chat template."}, timeout=60).json()
    assert (unrelated["cached_tokens"], unrelated["tier"]) == (0, None)
    # one replica alone (A, whose own cache holds turn 1) answers the same
    assert chat(a, history)["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


def test_embedded_redis_killed_mid_request_is_served_cold_then_recovers(redis_server: RedisServer, tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    b = replica(tmp_path, "b", redis_server.url)
    try:
        try:
            served_cold_with_redis_dead(b, redis_server)
        finally:
            redis_server.start()
        wait_until(lambda: httpx.get(b.url + "/health").json()["status"] == "ok", 60, "/health never recovered")
        assert stats(b)["remote_breaker_open"] == 0
        flush(b)  # the failed copies were reported by the flush before; none failed since
    finally:
        b.stop()


def served_cold_with_redis_dead(b: ServerProcess, redis_server: RedisServer) -> None:
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURN_1}]
    with httpx.Client(timeout=600) as client:
        request = client.build_request("POST", b.url + "/v1/chat/completions",
                                       json={"messages": history, "max_tokens": 48, "temperature": 0, "stream": True})
        response = client.send(request, stream=True)
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # generating
        redis_server.stop()
        rest = [line for line in lines if line]
    assert response.status_code == 200 and rest[-1] == "data: [DONE]"
    wait_until(lambda: httpx.get(b.url + "/health").json()["status"] == "degraded", 30, "/health never said degraded")
    assert httpx.get(b.url + "/health").status_code == 200
    served = chat(b, history + [{"role": "assistant", "content": "We bake."}, {"role": "user", "content": TURN_2}])
    assert served["choices"][0]["message"]["content"]
    assert stats(b)["remote_failures"] >= 1
    # the states are on B's SSD, not on the shared tier: the flush says so instead of answering 200
    response = httpx.post(b.url + "/admin/cache/flush", timeout=120)
    assert response.status_code == 503 and response.json()["error"]["code"] == "remote_writes_failed", response.text
    assert stats(b)["remote_writes_failed"] >= 2  # turn 1 and turn 2


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 1234}], ids=["greedy", "explicit-seed"])
def test_embedded_kill_on_a_resumes_exactly_on_b(sampling: dict[str, Any], redis_server: RedisServer, tmp_path: Path,
                                                 embedded_native: MlxAutoregressiveBinding) -> None:
    no_eos = {token: -100.0 for token in embedded_native.eos_token_ids}
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "logit_bias": {str(t): b for t, b in no_eos.items()}, **sampling}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = replica(tmp_path, "a", redis_server.url, "--generation-checkpoint", str(CHECKPOINT_EVERY))
    b = replica(tmp_path, "b", redis_server.url, "--generation-checkpoint", str(CHECKPOINT_EVERY))
    try:
        assert stream_until_killed(a, body) == KILL_AFTER
        resumed = complete(b, body)
    finally:
        a.stop()
        b.stop()
    assert resumed["usage"]["resumed_tokens"] >= DURABLE_AT
    expected = uninterrupted(embedded_native, SamplingParams(temperature=float(sampling["temperature"]),
                                                             seed=resumed["seed"], logit_bias=no_eos))
    assert resumed["choices"][0]["text"] == expected
