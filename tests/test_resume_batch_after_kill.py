"""Acceptance: `mlxkv serve --max-batch 8` killed with SIGKILL while four streams decode together;
after a restart each identical request continues from its own checkpoint and ends with exactly
the text it gets alone on an uninterrupted server."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.factories import EOS_ID, make_tiny_binding
from tests.server_process import ServerProcess
from tests.factories import save_mlx_lm_directory
from tests.test_resume_after_kill import complete, stream_chunks

MAX_TOKENS = 1500  # the EOS is barred, so every stream runs this long unless killed
KILL_AFTER = 60  # text chunks every stream has seen before the kill
CHECKPOINT_EVERY = 8
SAMPLINGS: list[tuple[str, dict[str, Any]]] = [
    ("Once upon a time", {"temperature": 0}), ("def f(x):", {"temperature": 0.9, "seed": 3}),
    ("1, 2, 3, 4,", {"temperature": 0}), ("Dear diary, today", {"temperature": 0.7, "seed": 9}),
]
BODIES: list[dict[str, Any]] = [
    {"prompt": prompt, "max_tokens": MAX_TOKENS, "logit_bias": {str(EOS_ID): -100}, **sampling} for prompt, sampling in SAMPLINGS
]


def serve(model: Path, cache: Path, *extra: str) -> ServerProcess:
    return ServerProcess(cache, "--model", str(model), "--generation-checkpoint", str(CHECKPOINT_EVERY), *extra)


def stream_all_until_killed(server: ServerProcess) -> None:
    """Stream the four requests together; once each has seen KILL_AFTER chunks, make the queued
    checkpoints durable and SIGKILL the server."""
    reached = [threading.Event() for _ in BODIES]

    def stream(index: int) -> None:
        seen = 0
        try:
            for chunk in stream_chunks(server.url, BODIES[index]):
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    seen += 1
                    if seen == KILL_AFTER:
                        reached[index].set()
        except httpx.HTTPError:
            pass  # the connection dies with the server

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(BODIES))]
    for thread in threads:
        thread.start()
    assert all(event.wait(300) for event in reached)
    assert httpx.post(server.url + "/admin/cache/flush", timeout=120).status_code == 200
    server.process.kill()
    server.process.wait(30)
    for thread in threads:
        thread.join(60)


def test_sigkill_with_four_streams_in_one_batch_then_each_retry_continues_exactly(tmp_path: Path) -> None:
    model = tmp_path / "model"
    save_mlx_lm_directory(make_tiny_binding("llama", seed=6), model)
    alone = serve(model, tmp_path / "alone-cache", "--max-batch", "1")
    try:
        expected = [complete(alone, body)["choices"][0]["text"] for body in BODIES]
    finally:
        alone.stop()
    cache = tmp_path / "cache"
    first = serve(model, cache, "--max-batch", "8")
    try:
        stream_all_until_killed(first)
    finally:
        first.stop()
    assert len(list(cache.rglob("checkpoints/*.mlxkv"))) == len(BODIES)
    second = serve(model, cache, "--max-batch", "8")
    try:
        with ThreadPoolExecutor(len(BODIES)) as pool:  # the retries resume together, in one batch
            resumed = list(pool.map(lambda body: complete(second, body), BODIES))
    finally:
        second.stop()
    for reply, text in zip(resumed, expected):
        assert reply["usage"]["resumed_tokens"] >= KILL_AFTER - CHECKPOINT_EVERY
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS
        assert reply["choices"][0]["text"] == text
