"""The HTTP API on a live server with the embedded model, driven by the official SDKs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxkv.engine.cache_services import build_tiers
from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding
from mlxkv_inference.tokenizer.chat import encode_chat
from mlxkv_serve import ServeConfig, build_app
from tests.serving import running

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model(embedded_native: MlxAutoregressiveBinding) -> MlxAutoregressiveBinding:
    """The embedded model on the native kernels, as `mlxkv serve` runs it (on MLX's own kernels this
    module took ~5 minutes of a loaded 2-core machine)."""
    return embedded_native


@pytest.fixture(scope="module")
def engine(model: MlxAutoregressiveBinding, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    tiers, cold = build_tiers(model, ram_bytes=1 << 30, ssd_dir=tmp_path_factory.mktemp("ssd"), ssd_bytes=1 << 30)
    engine = LocalEngine(model, tiers, ssd=cold)
    yield engine
    engine.close(30)


@pytest.fixture(scope="module")
def base_url(engine: LocalEngine, model: MlxAutoregressiveBinding) -> Iterator[str]:
    config = ServeConfig(vocab_size=model.tokenizer.vocab_size, default_max_tokens=64, max_body_bytes=1 << 20)
    with running(build_app(engine, config)) as url:
        yield url


@pytest.fixture()
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def test_chat_completion_answers_and_echoes_the_model(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model="anything", messages=QUESTION, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    assert reply.model == "SmolLM2-135M-Instruct-Q4_1"
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.prompt_tokens == 37 and reply.usage.completion_tokens == 7
    assert isinstance((reply.model_extra or {}).get("seed"), int)


def test_chat_stream_matches_the_non_streaming_text_and_reports_usage(oai: openai.OpenAI) -> None:
    chunks = list(oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=24, temperature=0, stream=True,  # type: ignore[call-overload]
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    raw = httpx.post(str(oai.base_url) + "chat/completions", json={"messages": QUESTION, "max_tokens": 3, "stream": True,
                                                                   "stream_options": {"include_usage": True}}, timeout=60)
    frames = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
    assert all("usage" in f and f["usage"] is None for f in frames[:-1]) and frames[-1]["usage"]["completion_tokens"] == 3


def test_second_turn_reports_cached_tokens(oai: openai.OpenAI) -> None:
    first = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8)
    history = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "And a vegetable?"}]
    second = oai.chat.completions.create(model="m", messages=history, max_tokens=8)  # type: ignore[arg-type]
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1  # type: ignore[union-attr]


def test_completions_stream_and_not(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model="m", prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(model="m", prompt="The capital of France is",
                                                                          max_tokens=8, temperature=0, stream=True))
    assert whole.choices[0].text == streamed and "Paris" in streamed
    assert whole.object == "text_completion"


def test_stop_string_cuts_the_text(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=24, stop=[" Paris"])  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "The capital of France is"
    assert reply.choices[0].finish_reason == "stop"


def test_same_seed_same_text(oai: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell me a story."}],
                                            max_tokens=16, temperature=0.8, seed=seed)
        assert (reply.model_extra or {}).get("seed") == seed
        return reply.choices[0].message.content or ""

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_logprobs_are_returned(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=2)  # type: ignore[arg-type]
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [c.token for c in content] == ["The", " capital", " of", " France"]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_logprob_bytes_of_tokens_holding_parts_of_characters_join_back_into_the_text(base_url: str) -> None:
    japanese = [{"role": "user", "content": "日本語の文章：東京は"}]
    reply = httpx.post(base_url + "/v1/chat/completions", json={"messages": japanese, "max_tokens": 12, "logprobs": True,
                                                                "top_logprobs": 1}, timeout=60).json()
    content = reply["choices"][0]["logprobs"]["content"]
    assert any(item["token"] == "\ufffd" for item in content)  # the answer has tokens that are parts of characters
    joined = b"".join(bytes(item["bytes"]) for item in content)
    assert joined.decode("utf-8", "ignore") == reply["choices"][0]["message"]["content"]
    completion = httpx.post(base_url + "/v1/completions", json={"prompt": "日本語の文章：東京は", "max_tokens": 12, "logprobs": 1},
                            timeout=60).json()["choices"][0]
    offsets, text = completion["logprobs"]["text_offset"], completion["text"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)


def test_anthropic_answer_continues_a_final_assistant_message(claude: anthropic.Anthropic, model: MlxAutoregressiveBinding) -> None:
    ask, start = "Give me a JSON object for a cat with name and age.", '{"name": "'
    turns: Any = [{"role": "user", "content": ask}, {"role": "assistant", "content": start}]
    prompt = encode_chat(model.tokenizer, turns[:1], answer_start=start).tokens
    assert prompt == model.tokenizer.encode(model.tokenizer.apply_chat_template(turns[:1]) + start, add_special_tokens=False)
    expected = Generation(model, prompt, GenerationParams(max_tokens=12)).run().text
    message = claude.messages.create(model="m", max_tokens=12, messages=turns)
    with claude.messages.stream(model="m", max_tokens=12, messages=turns) as stream:
        streamed = "".join(stream.text_stream)
    assert message.content[0].text == expected == streamed  # type: ignore[union-attr]
    assert not expected.startswith("{")  # it continues the object rather than starting one
    refused = httpx.post(str(claude.base_url) + "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": turns,
                                                                      "regex": "[a-z]+"})
    assert refused.status_code == 400 and "final assistant message" in refused.json()["error"]["message"]


def test_anthropic_messages_stream_and_not(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model="m", max_tokens=24, messages=QUESTION)  # type: ignore[arg-type]
    assert message.content[0].text == "The capital of France is Paris."  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 7
    system = "You are a geography teacher."
    plain = claude.messages.create(model="m", max_tokens=24, system=system, messages=QUESTION)  # type: ignore[arg-type]
    with claude.messages.stream(model="m", max_tokens=24, system=system, messages=QUESTION) as stream:  # type: ignore[arg-type]
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == plain.content[0].text and final.stop_reason == plain.stop_reason  # type: ignore[union-attr]
    # the system prompt replaces the template's default one
    assert plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0) != 37
    capped = claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "Capital of France?"}])
    assert capped.stop_reason == "max_tokens"
    stopped = claude.messages.create(model="m", max_tokens=24, stop_sequences=[" Paris"], messages=QUESTION)  # type: ignore[arg-type]
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " Paris"


def test_models_health_cache_stats_and_flush(base_url: str, oai: openai.OpenAI) -> None:
    oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]  # something to cache
    models = httpx.get(base_url + "/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct-Q4_1"
    assert httpx.get(base_url + "/health").json()["status"] == "ok"
    flushed = httpx.post(base_url + "/admin/cache/flush", timeout=60)
    assert flushed.status_code == 200 and flushed.json()["pending_writes"] == 0
    stats = httpx.get(base_url + "/v1/cache/stats").json()
    assert stats["ram_entries"] >= 1 and stats["writes_done"] >= 1
    assert stats["ssd_entries"] >= 1 and 0 < stats["ssd_bytes"] <= stats["ssd_max_bytes"]


def metric_values(base_url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(base_url + "/metrics").text)
    return {f"{s.name}{sorted(s.labels.items())}": s.value for f in families for s in f.samples}


def test_metrics_parse_and_counters_move(base_url: str, oai: openai.OpenAI) -> None:
    before = metric_values(base_url)
    oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)  # type: ignore[arg-type]
    after = metric_values(base_url)
    key = "mlxkv_requests_total[('endpoint', '/v1/chat/completions'), ('status', '200')]"
    assert after[key] == before.get(key, 0) + 1
    assert after["mlxkv_completion_tokens_total[]"] == before["mlxkv_completion_tokens_total[]"] + 4
    assert after["mlxkv_time_to_first_token_seconds_count[]"] == before["mlxkv_time_to_first_token_seconds_count[]"] + 1
    assert "mlxkv_cache_ram_hits[]" in after and "mlxkv_cache_ram_bytes[]" in after and "mlxkv_cache_ssd_bytes[]" in after


def test_client_disconnect_cancels_the_generation(base_url: str) -> None:
    body = {"messages": [{"role": "user", "content": "Write a long essay about rivers."}], "max_tokens": 300, "stream": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        generation_id = response.headers["x-mlxkv-generation-id"]
        for i, _ in enumerate(response.iter_lines()):
            if i > 6:
                break
    import time

    deadline = time.monotonic() + 60
    state: dict[str, object] = {}
    while time.monotonic() < deadline:
        state = httpx.get(f"{base_url}/v1/generations/{generation_id}").json()
        if state["status"] != "running":
            break
        time.sleep(0.2)
    assert state["status"] == "cancelled" and isinstance(state["completion_tokens"], int) and state["completion_tokens"] < 300
