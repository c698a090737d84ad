"""`mlxkv serve` as a process: SIGTERM stops it cleanly with the prompt cache flushed."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from tests.server_process import ServerProcess


def test_sigterm_finishes_in_flight_work_flushes_the_cache_and_exits(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    server = ServerProcess(cache)
    try:
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
