"""A reasoning model's think section under control: it may come before a grammar-forced tool call,
it is closed when `thinking.budget_tokens` is spent, and turning thinking off reaches the template
(`enable_thinking`) or, where the template ignores it, closes the section at once. Tiny random-weight
models: an R1-style template that opens the section, and Qwen3's template with its switch."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from mlxkv.engine.local_engine import LocalEngine
from mlxkv.engine.thinking import ThinkPlan, ThinkTags, think_plan
from mlxkv.engine.tool_calls import ToolUse, chat_messages, constrained_grammar, split_tool_calls, think_grammar
from mlxkv_inference import Generation, GenerationParams, SamplingParams
from mlxkv_inference.tokenizer.chat import encode_chat
from mlxkv_serve import ChatMessage, Constraint, Delta, Finished, GenerateRequest, Sampling, ServeConfig, Tool, ToolCall, build_app
from tests.chat_templates import TemplateTokenizer
from tests.factories import TINY_VOCAB, make_tiny_binding
from tests.test_reasoning import CLOSE_ID, OPEN_ID, ThinkingByteTokenizer

CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = (Tool("get_time", "The time", json.dumps(CLOCK)),)
PROMPT = "<user>Hi\n<assistant><think>\n"  # what ThinkingByteTokenizer's template renders for one "Hi"
NEVER_CLOSE = {CLOSE_ID: -1e9}  # the model would think on forever: only the budget closes the section


def test_the_plan_follows_the_think_tags_at_the_end_of_the_prompt() -> None:
    tags = ThinkTags(OPEN_ID, CLOSE_ID)
    assert think_plan(tags, [5, 6, OPEN_ID, 10], 7) == ThinkPlan(tags, True, 7)  # the template opened it
    assert think_plan(tags, [5, 6, 7, 8], None) == ThinkPlan(tags, False, None)  # the model may open it
    assert think_plan(tags, [OPEN_ID, 10, 10, CLOSE_ID, 10, 10], None) is None  # closed by the template: no thinking
    assert think_plan(None, [OPEN_ID], None) is None
    with pytest.raises(ValueError, match="think budget=-1"):
        ThinkPlan(tags, True, -1)


@pytest.mark.parametrize("budget", [0, 3, 9])
def test_the_think_section_is_closed_when_its_budget_is_spent(budget: int) -> None:
    tokenizer = ThinkingByteTokenizer()
    binding = make_tiny_binding("qwen3", seed=3, tokenizer=tokenizer)
    prompt = tokenizer.encode(PROMPT)
    grammar = think_grammar(ThinkPlan(ThinkTags(OPEN_ID, CLOSE_ID), True, budget))
    params = GenerationParams(max_tokens=budget + 6, grammar=grammar, sampling=SamplingParams(logit_bias=NEVER_CLOSE))
    tokens = Generation(binding, prompt, params).run().token_ids
    assert tokens.index(CLOSE_ID) == budget and tokens.count(CLOSE_ID) == 1


def test_a_forced_tool_call_follows_the_think_section_within_its_budget() -> None:
    """With the section opened by the template, `tool_choice` required: reasoning (closed at the
    budget), then a call, through the engine as the APIs use it."""
    tokenizer = ThinkingByteTokenizer()
    engine = LocalEngine(make_tiny_binding("qwen3", seed=3, tokenizer=tokenizer), None)
    try:
        request = GenerateRequest(max_tokens=120, sampling=Sampling(0.0, logit_bias=NEVER_CLOSE), messages=(ChatMessage("user", "Hi"),),
                                  tools=TOOLS, tool_choice="required", parallel_tool_calls=False, thinking_budget=5)
        reasoning, text, calls, finish = asyncio.run(answer(engine, request))
    finally:
        engine.close(30)
    binding = make_tiny_binding("qwen3", seed=3, tokenizer=tokenizer)
    prompt = engine_prompt(tokenizer)
    grammar = ToolUse(TOOLS, TOOLS, True, False).grammar(ThinkPlan(ThinkTags(OPEN_ID, CLOSE_ID), True, 5))
    oracle = Generation(binding, prompt, GenerationParams(max_tokens=120, grammar=grammar, sampling=SamplingParams(logit_bias=NEVER_CLOSE))).run()
    assert oracle.token_ids.index(CLOSE_ID) == 5
    think, _, after = oracle.text.partition("</think>")
    assert (reasoning, text, finish) == (think, "", "tool_calls")
    assert calls == split_tool_calls(after.lstrip("\n"), TOOLS, calls[0].id.rsplit("_", 1)[0])[1] and calls[0].name == "get_time"


def engine_prompt(tokenizer: ThinkingByteTokenizer) -> list[int]:
    """The prompt the engine builds for one "Hi" with TOOLS (the template takes no tools: they are
    described in a system turn)."""
    return encode_chat(tokenizer, chat_messages((ChatMessage("user", "Hi"),), TOOLS, False)).tokens


async def answer(engine: LocalEngine, request: GenerateRequest) -> tuple[str, str, tuple[ToolCall, ...], str]:
    handle = await engine.submit(request)
    reasoning = text = ""
    async for event in handle.events():
        if isinstance(event, Delta):
            reasoning, text = reasoning + event.reasoning, text + event.text
        elif isinstance(event, Finished):
            return reasoning, text, event.tool_calls, event.finish_reason
    raise AssertionError("the stream ended without Finished")


@pytest.fixture(scope="module")
def r1_client() -> Iterator[TestClient]:
    engine = LocalEngine(make_tiny_binding("qwen3", seed=3, tokenizer=ThinkingByteTokenizer()), None)
    with TestClient(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB)), raise_server_exceptions=False) as client:
        yield client
    engine.close(30)


def test_anthropic_thinking_disabled_closes_a_section_the_template_opens(r1_client: TestClient) -> None:
    """The R1-style template opens <think> whatever it is told: with thinking disabled the section
    is closed at once (its first token is `</think>`), and the answer is what follows it."""
    tokenizer = ThinkingByteTokenizer()
    grammar = think_grammar(ThinkPlan(ThinkTags(OPEN_ID, CLOSE_ID), True, 0))
    oracle = Generation(make_tiny_binding("qwen3", seed=3, tokenizer=tokenizer), tokenizer.encode(PROMPT),
                        GenerationParams(max_tokens=13, grammar=grammar)).run()
    assert oracle.token_ids[0] == CLOSE_ID
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 13, "thinking": {"type": "disabled"}}
    content = r1_client.post("/v1/messages", json=body).json()["content"]
    assert content == [{"type": "text", "text": oracle.text.removeprefix("</think>").lstrip("\n")}]
    enabled = r1_client.post("/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": 1024},
                                                   "max_tokens": 1100}).json()["content"]
    assert enabled[0]["type"] == "thinking" and enabled[0]["thinking"]  # thinking on: the section is its own block


@pytest.fixture(scope="module")
def qwen3_client() -> Iterator[tuple[TestClient, TemplateTokenizer]]:
    tokenizer = TemplateTokenizer("qwen3")
    engine = LocalEngine(make_tiny_binding("qwen3", seed=3, tokenizer=tokenizer), None)
    with TestClient(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB)), raise_server_exceptions=False) as client:
        yield client, tokenizer
    engine.close(30)


def test_enable_thinking_false_reaches_a_template_that_takes_it(qwen3_client: tuple[TestClient, TemplateTokenizer]) -> None:
    client, tokenizer = qwen3_client
    off = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    raw = client.post("/v1/completions", json={"prompt": off, "max_tokens": 8}).json()["choices"][0]["text"]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}}
    reply = client.post("/v1/chat/completions", json=body).json()
    assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(off))
    assert reply["choices"][0]["message"]["content"] == raw and "reasoning_content" not in reply["choices"][0]["message"]
    bad = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": "no"}})
    assert bad.status_code == 400 and "enable_thinking" in bad.json()["error"]["message"]


def test_a_json_answer_follows_the_think_section_closed_at_its_budget(r1_client: TestClient) -> None:
    """A user's JSON schema with a budget: the budget bounds the think section, the schema the answer
    after it (OpenAI chat's `thinking_token_budget`, Responses' `reasoning.max_tokens`)."""
    schema = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}
    bias = {str(CLOSE_ID): -100}
    chat = r1_client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "thinking_token_budget": 4, "logit_bias": bias,
        "response_format": {"type": "json_schema", "json_schema": {"name": "clock", "schema": schema}}}).json()["choices"][0]
    message = chat["message"]
    assert chat["finish_reason"] == "stop" and len(ThinkingByteTokenizer().encode(message["reasoning_content"])) == 4
    assert json.loads(message["content"]) in ({"zone": "utc"}, {"zone": "cet"})
    response = r1_client.post("/v1/responses", json={
        "input": "Hi", "max_output_tokens": 40, "reasoning": {"max_tokens": 4}, "store": False,
        "text": {"format": {"type": "json_schema", "name": "clock", "schema": schema}}}).json()
    reasoning = [i for i in response["output"] if i["type"] == "reasoning"]
    text = [i for i in response["output"] if i["type"] == "message"][0]["content"][0]["text"]
    assert len(ThinkingByteTokenizer().encode(reasoning[0]["summary"][0]["text"])) == 4 and json.loads(text) in ({"zone": "utc"}, {"zone": "cet"})


def test_a_regex_answer_follows_the_think_section_closed_at_its_budget(r1_client: TestClient) -> None:
    chat = r1_client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "thinking_token_budget": 3,
        "logit_bias": {str(CLOSE_ID): -100}, "regex": "[a-c]{2}/x"}).json()["choices"][0]
    tokenizer = ThinkingByteTokenizer()
    grammar = constrained_grammar(Constraint("regex", "[a-c]{2}/x"), ThinkPlan(ThinkTags(OPEN_ID, CLOSE_ID), True, 3))
    oracle = Generation(make_tiny_binding("qwen3", seed=3, tokenizer=tokenizer), tokenizer.encode(PROMPT),
                        GenerationParams(max_tokens=20, grammar=grammar, sampling=SamplingParams(logit_bias={CLOSE_ID: -100}))).run()
    assert oracle.token_ids.index(CLOSE_ID) == 3
    think, _, after = oracle.text.partition("</think>")
    assert re.fullmatch("[a-c]{2}/x", after)
    assert (chat["finish_reason"], chat["message"]["reasoning_content"], chat["message"]["content"]) == ("stop", think, after)
