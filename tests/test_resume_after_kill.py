"""Acceptance: `mlxkv serve` killed with SIGKILL mid-generation; after a restart the identical
request continues from its checkpoint and ends with exactly the uninterrupted run's text. The
server speculates (prompt lookup); the uninterrupted reference does not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxkv_inference import GenerationParams, MlxAutoregressiveBinding, SamplingParams
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.prompt_cache import TieredPromptCache
from tests.server_process import ServerProcess

# A story the embedded model tells for 200 tokens, its EOS barred (a server-chosen seed may end a
# story early otherwise: seen once), so the kill lands mid-way.
PROMPT = "Once upon a time, in a kingdom by the sea, there lived"
MAX_TOKENS = 200
KILL_AFTER = 100
CHECKPOINT_EVERY = 16
DURABLE_AT = KILL_AFTER // CHECKPOINT_EVERY * CHECKPOINT_EVERY


def stream_chunks(url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


def stream_until_killed(server: ServerProcess, body: dict[str, Any]) -> int:
    """Stream the request; after KILL_AFTER text chunks wait until the checkpoints written so far
    are durable, then SIGKILL the server. Returns the chunks seen."""
    seen = 0
    try:
        for chunk in stream_chunks(server.url, body):
            if chunk["choices"] and chunk["choices"][0]["text"]:
                seen += 1
                if seen == KILL_AFTER:
                    # KILL_AFTER chunks took at least as many tokens, so the checkpoint at
                    # DURABLE_AT was queued; the flush returns once it (or a newer one) is on disk.
                    flushed = httpx.post(server.url + "/admin/cache/flush", timeout=120)
                    assert flushed.status_code == 200, flushed.text
                    server.process.kill()
                    break  # chunks already buffered on this side came before the kill, not after
    except httpx.HTTPError:
        pass  # the connection dies with the server
    server.process.wait(30)
    return seen


def complete(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def generation_state(server: ServerProcess, response_id: str) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/v1/generations/{response_id.removeprefix('cmpl-')}")
    assert response.status_code == 200, response.text
    state: dict[str, Any] = response.json()
    return state


def uninterrupted(binding: MlxAutoregressiveBinding, sampling: SamplingParams) -> str:
    """The same request run to the end in this process, along the server's path (prompt cache on)."""
    generator = CachedGenerator(binding, TieredPromptCache(1 << 30))
    generation = generator.start(binding.tokenizer.encode(PROMPT), GenerationParams(max_tokens=MAX_TOKENS, sampling=sampling))
    return generation.run().text


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 0.8, "seed": 1234}, {"temperature": 0.8}],
    ids=["greedy", "explicit-seed", "server-seed"],
)
def test_sigkill_then_identical_retry_continues_exactly(sampling: dict[str, Any], embedded_native: MlxAutoregressiveBinding, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    no_eos = {token: -100.0 for token in embedded_native.eos_token_ids}
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "speculative": {"mode": "prompt_lookup", "num_draft_tokens": 4},
            "logit_bias": {str(token): bias for token, bias in no_eos.items()}, **sampling}
    first = ServerProcess(cache, "--generation-checkpoint", str(CHECKPOINT_EVERY))
    try:
        assert stream_until_killed(first, body) == KILL_AFTER
    finally:
        first.stop()
    assert list((cache).rglob("checkpoints/*.mlxkv")) != []
    second = ServerProcess(cache, "--generation-checkpoint", str(CHECKPOINT_EVERY))
    try:
        resumed = complete(second, body)
        resumed_tokens = generation_state(second, resumed["id"])["resumed_tokens"]
    finally:
        second.stop()
    usage = resumed["usage"]
    assert usage["completion_tokens"] > KILL_AFTER + 20
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    # The checkpoint made durable before the kill (or a newer one), never an older one.
    assert usage["resumed_tokens"] == resumed_tokens
    assert resumed_tokens >= DURABLE_AT and resumed_tokens % CHECKPOINT_EVERY == 0
    expected = uninterrupted(embedded_native, SamplingParams(temperature=float(sampling["temperature"]), seed=resumed["seed"],
                                                             logit_bias=no_eos))
    assert resumed["choices"][0]["text"] == expected
    if "seed" in sampling:
        assert resumed["seed"] == sampling["seed"]


def test_kill_during_a_checkpoint_write_leaves_a_usable_state(embedded_native: MlxAutoregressiveBinding, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    first = ServerProcess(cache, "--generation-checkpoint", "16")
    try:
        stream_until_killed(first, body)
    finally:
        first.stop()
    checkpoint = next(cache.rglob("checkpoints/*.mlxkv"))
    durable = checkpoint.read_bytes()
    # What a writer killed mid-write leaves: a partial tmp file beside the last durable checkpoint.
    partial = checkpoint.with_name(checkpoint.name + ".4242.1.tmp")
    partial.write_bytes(durable[: len(durable) // 2])
    # And, worse, a checkpoint file that is itself cut short (a filesystem without atomic rename).
    checkpoint.write_bytes(durable[: len(durable) // 2])
    expected = uninterrupted(embedded_native, SamplingParams())
    second = ServerProcess(cache, "--generation-checkpoint", "16")
    try:
        fresh = complete(second, body)  # the cut checkpoint is ignored: a fresh generation
        assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] < fresh["usage"]["prompt_tokens"]
        assert fresh["choices"][0]["text"] == expected
        # The finished generation's checkpoint removal is written behind: let it land first.
        assert httpx.post(second.url + "/admin/cache/flush", timeout=120).status_code == 200
        checkpoint.write_bytes(durable)  # the durable checkpoint beside the partial tmp
        resumed = complete(second, body)
        assert resumed["usage"]["resumed_tokens"] > 0
        assert resumed["choices"][0]["text"] == expected
    finally:
        second.stop()
