"""`mlxkv serve` as a process: SIGTERM stops it cleanly with the prompt cache flushed."""

from __future__ import annotations

import signal
import sys
import socket
import time
from pathlib import Path

import httpx

from tests.server_process import ServerProcess


def test_sigterm_finishes_in_flight_work_flushes_the_cache_and_exits(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    server = ServerProcess(cache)
    try:
        health = httpx.get(server.url + "/health").json()
        assert health["batch_exactness"] == "strict"  # the default
        if sys.platform == "linux":  # the CLI's defaults: the native kernels and the fixed-order sgemm shim
            assert health["cpu_kernels"].startswith("native (") and health["blas"].startswith("mlxkv-sgemm")
            memory = health["memory"]  # the server's own process, measured
            assert memory["rss_bytes"] > 0 and memory["in_use_bytes"] == max(memory["planned_bytes"], memory["measured_bytes"])
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12}
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as response:
            lines = response.iter_lines()
            next(lines)  # the generation is running
            server.process.send_signal(signal.SIGTERM)
            rest = list(lines)  # the in-flight stream still completes
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert server.process.wait(60) == 0
        assert list(cache.rglob("*.mlxkv")) != []  # flushed before exit
        assert list(cache.rglob("*.tmp")) == []
    finally:
        server.stop()


def test_sigterm_shutdown_logs_no_error(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "cache", "--log-level", "info")
    try:
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
    finally:
        server.stop()
    log = server.log.read_text()
    assert log.rstrip().endswith("prompt cache flushed; bye")
    assert " ERROR " not in log and "Traceback" not in log and "CancelledError" not in log, log


def test_forced_shutdown_logs_no_lifespan_traceback(tmp_path: Path) -> None:
    """A second SIGTERM forces the exit while a generation streams: the cache is still flushed, and
    no lifespan task is left to be cancelled (Starlette logged that as an ERROR traceback)."""
    server = ServerProcess(tmp_path / "cache", "--log-level", "info")
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 60, "stream": True}
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            next(lines)  # the generation is running
            server.process.send_signal(signal.SIGTERM)
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(60) == 0
    except httpx.HTTPError:
        pass  # the forced exit may cut the stream
    finally:
        server.stop()
    log = server.log.read_text()
    assert log.rstrip().endswith("prompt cache flushed; bye")
    assert "in lifespan" not in log and "Waiting for application" not in log, log


def test_connection_limit_and_request_timeout_reach_the_server(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "cache", "--max-connections", "2", "--request-timeout", "1")
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        assert httpx.get(server.url + "/health", timeout=30).status_code == 503  # two silent connections fill the limit
        for sock in idle:
            sock.settimeout(60)
            assert sock.recv(1024) == b""  # closed by the server: nothing was sent within the request timeout
            sock.close()
        deadline = time.monotonic() + 60
        while (status := httpx.get(server.url + "/health", timeout=30).status_code) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200
    finally:
        server.stop()
