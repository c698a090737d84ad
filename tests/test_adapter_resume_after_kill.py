"""`mlxkv serve` with an adapter, killed with SIGKILL mid-generation: after a restart the identical
request (same adapter) continues from its checkpoint and ends with the text an uninterrupted run
under that adapter gives; the same request on the base model does not touch that checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.adapter_factories import write_random_adapter
from tests.factories import EOS_ID, make_tiny_binding, save_mlx_lm_directory
from tests.server_process import ServerProcess

KILL_AFTER = 30  # text chunks seen before the kill
CHECKPOINT_EVERY = 8


def kill_mid_stream(server: ServerProcess, body: dict[str, Any]) -> int:
    seen = 0
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    seen += 1
                    if seen == KILL_AFTER:
                        assert httpx.post(server.url + "/admin/cache/flush", timeout=120).status_code == 200
                        server.process.kill()
                        break
    except httpx.HTTPError:
        pass
    server.process.wait(30)
    return seen


def complete(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_sigkill_then_the_identical_request_under_its_adapter_continues_exactly(tmp_path: Path) -> None:
    base = make_tiny_binding("llama", seed=5)
    model = save_mlx_lm_directory(base, tmp_path / "tiny-llama")
    adapter = write_random_adapter(base, tmp_path / "adapter", seed=3)
    args = ("--model", str(model), "--adapter", f"story={adapter}", "--generation-checkpoint", str(CHECKPOINT_EVERY))
    body = {"model": "story", "prompt": "Once upon a time", "max_tokens": 160, "temperature": 0.8, "seed": 11,
            "logit_bias": {str(EOS_ID): -100.0}}
    cache = tmp_path / "cache"
    first = ServerProcess(cache, *args)
    try:
        assert kill_mid_stream(first, body) == KILL_AFTER
    finally:
        first.stop()
    second = ServerProcess(cache, *args)
    try:
        on_base = complete(second, {**body, "model": "tiny-llama"})
        resumed = complete(second, body)
        assert httpx.post(second.url + "/admin/cache/flush", timeout=120).status_code == 200  # the checkpoint's removal lands
        again = complete(second, body)  # no checkpoint left: generated from the prompt (cached) to the end
    finally:
        second.stop()
    assert "resumed_tokens" not in on_base["usage"] or not on_base["usage"]["resumed_tokens"]
    assert resumed["usage"]["resumed_tokens"] >= KILL_AFTER // CHECKPOINT_EVERY * CHECKPOINT_EVERY // 2
    assert "resumed_tokens" not in again["usage"] or not again["usage"]["resumed_tokens"]
    assert resumed["choices"][0]["text"] == again["choices"][0]["text"] != on_base["choices"][0]["text"]
