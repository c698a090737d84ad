"""/v1/responses on the embedded model, read back with the openai SDK's own types (non-streamed and
streamed), tools (namespaces flattened, hosted ones left out), stored responses and continuations."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mlxkv.engine.cache_services import build_tiers
from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_serve import ServeConfig, build_app
from mlxkv_serve.responses_store import DiskResponseStore
from tests.serving import running

WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SPAWN: Any = {"type": "function", "name": "spawn", "namespace": "agents"}
AGENTS: Any = {"type": "namespace", "name": "agents", "description": "Sub-agents",
          "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]}


@pytest.fixture(scope="module")
def served(embedded_native: MlxAutoregressiveBinding, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    # The native kernels: the tool prompt's prefill took ~30 s of a 2-core machine on MLX's own, ~1 s on these.
    ssd = tmp_path_factory.mktemp("ssd")
    tiers, cold = build_tiers(embedded_native, ram_bytes=1 << 30, ssd_dir=ssd, ssd_bytes=1 << 30)
    engine = LocalEngine(embedded_native, tiers, ssd=cold)
    config = ServeConfig(vocab_size=embedded_native.tokenizer.vocab_size, default_max_tokens=16, max_body_bytes=1 << 20)
    with running(build_app(engine, config, DiskResponseStore(ssd / "responses"))) as url:
        yield url, ssd / "responses"
    engine.close(30)


@pytest.fixture()
def oai(served: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def test_non_streamed_response_parses_with_the_sdk_and_matches_chat(oai: openai.OpenAI) -> None:
    chat = oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=3)
    response = oai.responses.create(model="any", input="What is the capital of France?", max_output_tokens=3)
    assert response.object == "response" and response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 3)
    assert response.usage.input_tokens_details.cached_tokens > 0  # the chat request prefilled the same prompt
    assert response.output[0].type == "message" and response.output[0].status == "completed"


def test_stream_events_are_numbered_in_order_and_end_with_the_final_response(oai: openai.OpenAI) -> None:
    with oai.responses.stream(model="any", input=[{"role": "developer", "content": "Be brief."},
                                                  {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                              max_output_tokens=6) as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]  # the SDK's get_final_response wants response.completed
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.status == "incomplete"
    again = oai.responses.create(model="any", input=[{"role": "developer", "content": "Be brief."},
                                                     {"role": "user", "content": "Hi"}], max_output_tokens=6)
    assert again.output_text == final.output_text


def test_forced_namespaced_call_comes_back_split_and_its_output_continues(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model="any", input="Start a helper.", tools=[WEATHER, AGENTS],
                                    tool_choice=SPAWN, parallel_tool_calls=False,
                                    max_output_tokens=64)
    calls = [o for o in response.output if o.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1
    assert (calls[0].name, calls[0].namespace, json.loads(calls[0].arguments)) == ("spawn", "agents", {})
    follow = oai.responses.create(model="any", previous_response_id=response.id, tools=[WEATHER, AGENTS],
                                  input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "started"}],
                                  max_output_tokens=4)
    assert follow.previous_response_id == response.id
    assert follow.usage is not None and response.usage is not None
    assert follow.usage.input_tokens_details.cached_tokens >= response.usage.input_tokens - 8


def test_streamed_call_sends_argument_events(oai: openai.OpenAI) -> None:
    with oai.responses.stream(model="any", input="Weather in Paris?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                              max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    call = final.output[-1]
    assert len(done) == 1 and call.type == "function_call" and call.name == "get_weather"
    assert done[0].arguments == call.arguments and "city" in json.loads(call.arguments)


def test_hosted_tools_are_left_out_and_reported(served: tuple[str, Path]) -> None:
    got = httpx.post(served[0] + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": False,
                                                         "tools": [{"type": "web_search"}, WEATHER]})
    assert got.status_code == 200 and got.headers["x-mlxkv-tools-left-out"] == "web_search"


def test_stored_response_is_retrieved_continued_and_deleted(oai: openai.OpenAI, served: tuple[str, Path]) -> None:
    first = oai.responses.create(model="any", input="Name a colour.", instructions="Answer in one word.", max_output_tokens=4)
    assert (served[1] / f"{first.id}.json").exists()
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    second = oai.responses.create(model="any", previous_response_id=first.id, input="Another one.", max_output_tokens=4)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        oai.responses.retrieve(first.id)
    assert missing.value.body["code"] == "response_not_found"  # type: ignore[index]


def test_store_false_keeps_nothing(served: tuple[str, Path]) -> None:
    got = httpx.post(served[0] + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": False}).json()
    assert got["store"] is False and not (served[1] / f"{got['id']}.json").exists()
    assert httpx.get(served[0] + f"/v1/responses/{got['id']}").status_code == 404


def _body(**fields: Any) -> dict[str, Any]:
    return {"input": "hi", "max_output_tokens": 2, **fields}
