"""The server under failure and abuse: a generation that raises, a full queue, requests that never
finish arriving, clients that leave mid-body. Real servers over real engines on a tiny model; the
failing or stalling part is a binding subclass."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_serve import ServeConfig, ServeEngine, bounded_http_protocol, build_app
from tests.bindings import FailingBinding, GatedBinding
from tests.factories import TINY_VOCAB, make_tiny_binding
from tests.serving import running

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello there"}]
WAIT_S = 60.0  # generous bound for a state the server must reach; never decides a result


def serve(engine: LocalEngine, **settings: Any) -> Any:
    return running(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB)), **settings)


def metric_values(base_url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(base_url + "/metrics").text)
    return {f"{s.name}{sorted(s.labels.items())}": s.value for f in families for s in f.samples}


def requests_with_status(values: dict[str, float], status: str) -> float:
    return sum(v for k, v in values.items() if k.startswith("mlxkv_requests_total") and f"('status', '{status}')" in k)


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"the server never reached: {what}")
        time.sleep(0.02)


@pytest.fixture()
def failing() -> Iterator[tuple[FailingBinding, LocalEngine]]:
    binding = make_tiny_binding("llama", binding_class=FailingBinding)
    assert isinstance(binding, FailingBinding)
    engine = LocalEngine(binding, None)
    yield binding, engine
    engine.close(30)


def test_a_failing_generation_is_a_500_in_each_api_shape_counted_and_logged(
    failing: tuple[FailingBinding, LocalEngine], caplog: pytest.LogCaptureFixture
) -> None:
    binding, engine = failing
    caplog.set_level(logging.ERROR)
    with serve(engine) as url:
        openai_reply = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 50}, timeout=WAIT_S)
        binding.decodes_left = 3
        anthropic_reply = httpx.post(url + "/v1/messages", json={"messages": MESSAGES, "max_tokens": 50}, timeout=WAIT_S)
        values = metric_values(url)
    assert openai_reply.status_code == 500
    error = openai_reply.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "generation_failed"
    assert error["message"].endswith("failed: RuntimeError: injected decode failure")
    assert anthropic_reply.status_code == 500
    assert anthropic_reply.json()["type"] == "error" and anthropic_reply.json()["error"]["type"] == "api_error"
    assert values["mlxkv_generation_failures_total[]"] == 2
    assert values["mlxkv_requests_total[('endpoint', '/v1/chat/completions'), ('status', '500')]"] == 1
    assert values["mlxkv_requests_total[('endpoint', '/v1/messages'), ('status', '500')]"] == 1
    logged = [r for r in caplog.records if r.name == "mlxkv.engine.local_engine" and r.exc_info]
    assert len(logged) == 2 and "injected decode failure" in str(logged[0].exc_info[1])  # type: ignore[index]


def sse_events(url: str, path: str, body: dict[str, Any]) -> list[tuple[str | None, str]]:
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=WAIT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, line[6:]))
                name = None
    return events


def test_a_failing_stream_ends_with_the_api_error_event(failing: tuple[FailingBinding, LocalEngine]) -> None:
    binding, engine = failing
    with serve(engine) as url:
        openai_events = sse_events(url, CHAT, {"messages": MESSAGES, "max_tokens": 50})
        binding.decodes_left = 3
        anthropic_events = sse_events(url, "/v1/messages", {"messages": MESSAGES, "max_tokens": 50})
        values = metric_values(url)
    last = json.loads(openai_events[-1][1])
    assert set(last) == {"error"} and last["error"]["type"] == "server_error" and "[DONE]" not in [d for _, d in openai_events]
    assert not any('"finish_reason":"cancelled"' in d for _, d in openai_events)
    name, data = anthropic_events[-1]
    assert name == "error" and json.loads(data)["error"]["type"] == "api_error"
    assert "message_stop" not in [n for n, _ in anthropic_events]
    assert values["mlxkv_generation_failures_total[]"] == 2


@pytest.fixture()
def gated() -> Iterator[tuple[GatedBinding, LocalEngine]]:
    """An engine whose first request holds the worker in its prefill until the test opens the
    gate; two requests may wait behind it."""
    binding = make_tiny_binding("llama", binding_class=GatedBinding)
    assert isinstance(binding, GatedBinding)
    engine = LocalEngine(binding, None, max_queue=2)
    yield binding, engine
    binding.gate.set()
    engine.close(30)


def start_chat(url: str, statuses: list[int]) -> threading.Thread:
    """A chat request on a thread of its own; its status lands in `statuses`."""
    def post() -> None:
        statuses.append(httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 2}, timeout=WAIT_S).status_code)

    thread = threading.Thread(target=post)
    thread.start()
    return thread


def test_a_full_queue_answers_429_with_retry_after_and_the_rest_complete(gated: tuple[GatedBinding, LocalEngine]) -> None:
    binding, engine = gated
    results: list[int] = []
    with serve(engine) as url:
        clients = [start_chat(url, results)]
        wait_for(binding.entered.is_set, "the first request running")
        clients += [start_chat(url, results) for _ in range(2)]
        wait_for(lambda: metric_values(url)["mlxkv_queue_depth[]"] == 2, "two requests queued")
        surplus = [httpx.post(url + path, json={"messages": MESSAGES, "prompt": "x", "max_tokens": 2}, timeout=WAIT_S)
                   for path in (CHAT, "/v1/completions", "/v1/messages")]
        binding.gate.set()
        for client in clients:
            client.join(WAIT_S)
        values = metric_values(url)
    assert sorted(results) == [200, 200, 200]
    assert [r.status_code for r in surplus] == [429, 429, 429]
    assert all(r.headers["retry-after"] == "1" for r in surplus)
    assert surplus[0].json()["error"]["code"] == "rate_limit_exceeded"
    assert surplus[2].json()["error"]["type"] == "rate_limit_error"
    assert values["mlxkv_queue_depth[]"] == 0
    assert requests_with_status(values, "429") == 3 and requests_with_status(values, "500") == 0


def test_requests_whose_clients_left_while_queued_free_their_places_at_once(gated: tuple[GatedBinding, LocalEngine]) -> None:
    binding, engine = gated
    results: list[int] = []
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode()
    with serve(engine) as url:
        clients = [start_chat(url, results)]
        wait_for(binding.entered.is_set, "the first request running")
        host, port = url.removeprefix("http://").split(":")
        leaving = [socket.create_connection((host, int(port)), timeout=WAIT_S) for _ in range(2)]
        for sock in leaving:
            sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: metric_values(url)["mlxkv_queue_depth[]"] == 2, "two requests queued")
        for sock in leaving:
            sock.close()
        # The batch is still held by the first request: the two places free up as their
        # clients are seen gone, not when the batch has room.
        wait_for(lambda: metric_values(url)["mlxkv_queue_depth[]"] == 0, "the requests whose clients left taken out")
        clients += [start_chat(url, results) for _ in range(2)]
        wait_for(lambda: metric_values(url)["mlxkv_queue_depth[]"] == 2, "two new requests queued")
        binding.gate.set()
        for client in clients:
            client.join(WAIT_S)
        values = metric_values(url)
    assert sorted(results) == [200, 200, 200]
    assert requests_with_status(values, "429") == 0 and requests_with_status(values, "500") == 0


@pytest.fixture(scope="module")
def tiny_engine() -> Iterator[ServeEngine]:
    engine = LocalEngine(make_tiny_binding("llama"), None)
    yield engine
    engine.close(30)


def read_until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a socket timeout fails the test)."""
    sock.settimeout(WAIT_S)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


INCOMPLETE_REQUESTS = {
    "content-length longer than the body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 100\r\n\r\n{\"mess",
    "unterminated chunked body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\n5\r\n{\"mes\r\n",
    "headers never finished": b"GET /health HTTP/1.1\r\nHost: x\r\n",
    "nothing sent": b"",
}


@pytest.mark.parametrize("request_bytes", INCOMPLETE_REQUESTS.values(), ids=INCOMPLETE_REQUESTS.keys())
def test_a_request_not_read_in_time_loses_its_connection(tiny_engine: LocalEngine, request_bytes: bytes) -> None:
    with serve(tiny_engine, http=bounded_http_protocol(0.5)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request_bytes)
            assert read_until_closed(sock) == b""
        assert httpx.get(url + "/health").status_code == 200  # the server itself is fine


def test_a_header_line_every_so_often_does_not_hold_the_connection(tiny_engine: LocalEngine) -> None:
    with serve(tiny_engine, http=bounded_http_protocol(0.5)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            sent = 0
            try:
                for sent in range(int(WAIT_S / 0.1)):
                    sock.sendall(f"x-slow-{sent}: y\r\n".encode())
                    time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert sent < int(WAIT_S / 0.1) - 1  # the server closed it long before the client gave up


def test_a_complete_request_is_answered_and_a_slow_answer_is_not_cut(tiny_engine: LocalEngine) -> None:
    with serve(tiny_engine, http=bounded_http_protocol(0.5)) as url:
        with httpx.Client(base_url=url, timeout=WAIT_S) as client:  # one keep-alive connection
            for _ in range(3):
                reply = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2})
                assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_a_client_leaving_mid_body_is_a_disconnect_not_a_500(tiny_engine: LocalEngine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with serve(tiny_engine, log_config=None) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{\"mess")
        wait_for(lambda: metric_values(url).get("mlxkv_client_disconnects_total[('endpoint', '/v1/chat/completions')]") == 1,
                 "the disconnect counted")
        values = metric_values(url)
    assert requests_with_status(values, "500") == 0
    assert not any("Exception in ASGI application" in r.getMessage() for r in caplog.records)
    gone = [r for r in caplog.records if "closed the connection while sending the body" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].exc_info is None


def test_a_bad_request_leaves_the_connection_usable(tiny_engine: LocalEngine) -> None:
    with serve(tiny_engine) as url, httpx.Client(base_url=url, timeout=WAIT_S) as client:
        for content in ("\ud800", "\udc00\ud800"):
            body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2})  # ASCII, \u escapes
            bad = client.post(CHAT, content=body, headers={"content-type": "application/json"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content"
            good = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2})
            assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_a_client_leaving_a_stream_is_counted_as_a_disconnect() -> None:
    binding = make_tiny_binding("llama", binding_class=GatedBinding)
    assert isinstance(binding, GatedBinding)
    engine = LocalEngine(binding, None)
    try:
        with serve(engine) as url:
            body = {"messages": MESSAGES, "max_tokens": 20, "stream": True}
            with httpx.stream("POST", url + CHAT, json=body, timeout=WAIT_S) as response:
                generation_id = response.headers["x-mlxkv-generation-id"]
                assert next(response.iter_lines()).startswith("data: ")  # the role chunk; the generation waits at the gate
            key = "mlxkv_client_disconnects_total[('endpoint', '/v1/chat/completions')]"
            wait_for(lambda: metric_values(url).get(key) == 1, "the stream disconnect counted")
            binding.gate.set()
            wait_for(lambda: httpx.get(f"{url}/v1/generations/{generation_id}").json()["status"] == "cancelled",
                     "the generation cancelled")
            values = metric_values(url)
    finally:
        binding.gate.set()
        engine.close(30)
    assert requests_with_status(values, "500") == 0 and values["mlxkv_generation_failures_total[]"] == 0


def test_a_prompt_being_tokenized_holds_up_no_other_request(monkeypatch: pytest.MonkeyPatch) -> None:
    binding = make_tiny_binding("llama")
    tokenizer = binding.tokenizer
    encode, entered, finished, gate = tokenizer.encode, threading.Event(), threading.Event(), threading.Event()

    def slow_encode(text: str, **kwargs: Any) -> list[int]:  # a prompt of megabytes, as the server sees it
        if text == "a long prompt":
            entered.set()
            gate.wait(WAIT_S / 4)
            finished.set()
        return encode(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    engine = LocalEngine(binding, None)
    statuses: list[int] = []
    try:
        with serve(engine) as url:
            body = {"prompt": "a long prompt", "max_tokens": 2}
            slow = threading.Thread(target=lambda: statuses.append(httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S).status_code))
            slow.start()
            wait_for(entered.is_set, "the long prompt being tokenized")
            health = httpx.get(url + "/health", timeout=WAIT_S)
            other = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=WAIT_S)
            answered_while_tokenizing = not finished.is_set()
            gate.set()
            slow.join(WAIT_S)
    finally:
        gate.set()
        engine.close(30)
    assert health.status_code == 200 and other.status_code == 200
    assert answered_while_tokenizing
    assert statuses == [200]


def test_max_tokens_shrinks_to_what_the_context_leaves(tiny_engine: ServeEngine) -> None:
    assert isinstance(tiny_engine, LocalEngine)
    room = 3
    prompt = [5 + i % 50 for i in range(tiny_engine.context_length - room)]
    with serve(tiny_engine) as url:
        fitted = httpx.post(url + "/v1/completions", json={"prompt": prompt}, timeout=WAIT_S)
        asked = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": room + 1}, timeout=WAIT_S)
        full = httpx.post(url + "/v1/completions", json={"prompt": prompt + [5] * room}, timeout=WAIT_S)
    assert fitted.status_code == 200, fitted.text
    assert fitted.json()["usage"]["completion_tokens"] <= room
    assert asked.status_code == 200, asked.text  # more than fits: lowered to the room left, not refused
    choice = asked.json()["choices"][0]
    assert asked.json()["usage"]["completion_tokens"] <= room
    assert choice["finish_reason"] == ("length" if asked.json()["usage"]["completion_tokens"] == room else "stop")
    assert full.status_code == 400 and full.json()["error"]["code"] == "context_length_exceeded"
    message = full.json()["error"]["message"]
    assert f"{tiny_engine.context_length} tokens" in message and f"has {tiny_engine.context_length} tokens" in message
