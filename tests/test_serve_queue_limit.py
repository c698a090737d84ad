"""Acceptance: `mlxkv serve --max-batch 1 --max-queue 4` under 20 simultaneous requests. While one
generation holds the only batch row, four requests wait and the other sixteen get 429 with
Retry-After in their API's error shape; nothing fails, the four complete once the row frees, and
the server stays healthy. A real server process on a tiny mlx-lm model directory."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.factories import EOS_ID, make_tiny_binding
from tests.server_process import ServerProcess
from tests.factories import save_mlx_lm_directory

CLIENTS = 20
MAX_QUEUE = 4
CONTEXT = 1 << 16
# The API's most. With the EOS barred the holder runs until its client leaves: the tiny model needs
# tens of seconds for these, the test holds the row for well under one (and fails, never passes, if
# the holder ends first: its status must end "cancelled").
HOLD_TOKENS = 32768
WAIT_S = 60.0  # generous bound for a state the server must reach; never decides a result
MESSAGES = [{"role": "user", "content": "hello there"}]
# The layout of the in-process ByteTokenizer's template; the /v1/chat and /v1/messages routes need one.
CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("queue-limit")
    model = root / "tiny-llama"
    save_mlx_lm_directory(make_tiny_binding("llama", max_position_embeddings=CONTEXT), model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": CHAT_TEMPLATE}))
    process = ServerProcess(root / "cache", "--model", str(model), "--no-ssd-cache", "--prompt-cache-bytes", "0",
                            "--max-batch", "1", "--max-queue", str(MAX_QUEUE))
    yield process
    process.stop()


def body(endpoint: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    if endpoint == "/v1/completions":
        return {"prompt": "hello there", "max_tokens": max_tokens, **extra}
    return {"messages": MESSAGES, "max_tokens": max_tokens, **extra}


def metric_values(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=WAIT_S).text)
    return {f"{s.name}{sorted(s.labels.items())}": s.value for f in families for s in f.samples}


def requests_with_status(values: dict[str, float], status: str) -> float:
    return sum(v for k, v in values.items() if k.startswith("mlxkv_requests_total") and f"('status', '{status}')" in k)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"the server never reached: {what}")
        time.sleep(0.02)


def test_twenty_requests_on_a_queue_of_four_give_sixteen_429s_and_four_completions(server: ServerProcess) -> None:
    url = server.url
    replies: dict[int, httpx.Response | Exception] = {}
    start = threading.Barrier(CLIENTS)

    def client(index: int) -> None:
        endpoint = ENDPOINTS[index % len(ENDPOINTS)]
        start.wait(WAIT_S)  # all twenty leave together
        try:
            replies[index] = httpx.post(url + endpoint, json=body(endpoint, 2), timeout=WAIT_S)
        except Exception as e:  # noqa: BLE001 - a dropped connection is a result the test reports
            replies[index] = e

    holder = body("/v1/chat/completions", HOLD_TOKENS, stream=True, logit_bias={str(EOS_ID): -100})
    with httpx.stream("POST", url + "/v1/chat/completions", json=holder, timeout=WAIT_S) as stream:
        assert stream.status_code == 200, stream.read()
        generation = f"{url}/v1/generations/{stream.headers['x-mlxkv-generation-id']}"
        wait_for(lambda: httpx.get(generation, timeout=WAIT_S).json()["status"] == "running", "the holder running")
        clients = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in clients:
            thread.start()
        wait_for(lambda: len(replies) == CLIENTS - MAX_QUEUE, "every request answered or queued")
        early = dict(replies)
        queued = metric_values(url)["mlxkv_queue_depth[]"]
    # the holder's client left: its generation is cancelled, the queue drains
    for thread in clients:
        thread.join(WAIT_S)
    wait_for(lambda: httpx.get(generation, timeout=WAIT_S).json()["status"] == "cancelled", "the holder cancelled")
    values = metric_values(url)
    after = httpx.post(url + "/v1/chat/completions", json=body("/v1/chat/completions", 2), timeout=WAIT_S)

    assert queued == MAX_QUEUE
    assert all(isinstance(r, httpx.Response) and r.status_code == 429 for r in early.values()), early
    assert sorted(r.status_code if isinstance(r, httpx.Response) else repr(r) for r in replies.values()) == [200] * 4 + [429] * 16
    for index, reply in replies.items():
        assert isinstance(reply, httpx.Response)
        if reply.status_code == 200:
            completed = reply.json()
            assert completed["usage"].get("completion_tokens", completed["usage"].get("output_tokens")) == 2
            continue
        assert reply.headers["retry-after"] == "1"
        error = reply.json()
        if ENDPOINTS[index % len(ENDPOINTS)] == "/v1/messages":
            assert error["type"] == "error" and error["error"]["type"] == "rate_limit_error"
        else:
            assert error["error"]["type"] == "rate_limit_error" and error["error"]["code"] == "rate_limit_exceeded"
    assert requests_with_status(values, "429") == 16 and requests_with_status(values, "500") == 0
    assert values["mlxkv_queue_depth[]"] == 0
    assert httpx.get(url + "/health", timeout=WAIT_S).status_code == 200
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
