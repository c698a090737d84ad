"""gpt-oss harmony answers on a tiny random-weight model with gpt-oss's real chat template: the
analysis channel comes out as reasoning and the final channel as text, a call's JSON arguments are
forced to match the tool's schema, the thinking budget closes the analysis, and a history of calls
and results is rendered by the template as harmony writes it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from mlxkv.engine.harmony import HarmonySplitter, harmony_answer_grammar, harmony_grammar, harmony_history, parse_harmony_calls
from mlxkv.engine.local_engine import LocalEngine
from mlxkv.engine.tool_calls import chat_messages, template_tools
from mlxkv.engine.tool_formats import model_tool_format
from mlxkv_inference import Generation, GenerationParams, Grammar, SamplingParams
from mlxkv_inference.tokenizer.chat import encode_chat
from mlxkv_serve import ChatMessage, Constraint, ServeConfig, Tool, ToolCall, build_app
from tests.chat_templates import TemplateTokenizer
from tests.factories import TINY_VOCAB, make_tiny_binding

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = (Tool("get_weather", "Weather forecast", json.dumps(WEATHER)), Tool("get_time", "The time", json.dumps(CLOCK)))
API_TOOLS: Any = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters)}}
                  for t in TOOLS]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."
CALL_MESSAGE = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"unit": "c", "days": 2}'
BUDGET = 6
# A forced call after an analysis of exactly BUDGET tokens (the model never ends it itself).
FORCED = re.compile(r"<\|channel\|>analysis<\|message\|>(?P<reasoning>.*)<\|end\|><\|start\|>assistant"
                    r"<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json<\|message\|>(?P<arguments>\{.*\})", re.DOTALL)

FINAL = re.compile(r"(?:<\|channel\|>analysis<\|message\|>(?P<reasoning>.*)<\|end\|><\|start\|>assistant)?"
                   r"<\|channel\|>final<\|message\|>(?P<text>.*)", re.DOTALL)
LITERAL = model_tool_format(TemplateTokenizer("gpt_oss")).literal


def split_streamed(text: str, step: int) -> tuple[str, str]:
    splitter, reasoning, answer = HarmonySplitter(), "", ""
    for i in range(0, len(text), step):
        r, t = splitter.feed(text[i:i + step])
        reasoning, answer = reasoning + r, answer + t
    r, t = splitter.finish()
    return reasoning + r, answer + t


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_analysis_is_reasoning_and_final_is_text_however_the_stream_is_cut(step: int) -> None:
    assert split_streamed(ANSWER, step) == ("Need the weather.", "It is sunny.")
    # A call message goes on as text from its call marker, for the tool-call reader.
    assert split_streamed("<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant" + CALL_MESSAGE, step) \
        == ("Call it.", CALL_MESSAGE)
    assert split_streamed("Hello <b>there</b>", step) == ("", "Hello <b>there</b>")  # no channels: plain text
    assert split_streamed("<|channel|>analysis<|message|>cut by max_tok", step) == ("cut by max_tok", "")


def test_a_call_is_read_with_its_recipient_before_or_after_the_channel() -> None:
    assert parse_harmony_calls(CALL_MESSAGE) == [("get_weather", {"unit": "c", "days": 2})]
    rendered = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "utc"}<|call|>'
    assert parse_harmony_calls(rendered) == [("get_time", {"zone": "utc"})]
    assert parse_harmony_calls(CALL_MESSAGE[:-5]) == []  # cut short
    assert parse_harmony_calls('<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"q": 1}') == []


def test_a_turn_of_two_calls_renders_as_two_harmony_calls_each_followed_by_its_result() -> None:
    """The real template renders only a turn's first call: the history is split into one turn a call."""
    tokenizer = TemplateTokenizer("gpt_oss")
    calls = (ToolCall("c1", "get_weather", '{"unit": "c", "days": 2}'), ToolCall("c2", "get_time", '{"zone": "utc"}'))
    history = (ChatMessage("user", "Weather and time?"), ChatMessage("assistant", "", tool_calls=calls),
               ChatMessage("tool", "sunny", tool_call_id="c1"), ChatMessage("tool", "noon", tool_call_id="c2"))
    text = tokenizer.apply_chat_template(chat_messages(harmony_history(history), TOOLS, True), tools=template_tools(TOOLS))
    assert text[text.index("<|start|>user"):] == (
        "<|start|>user<|message|>Weather and time?<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"unit": "c", "days": 2}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "utc"}<|call|>'
        '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"noon"<|end|>'
        "<|start|>assistant")
    assert "functions.get_time<|channel|>" not in tokenizer.apply_chat_template(chat_messages(history, TOOLS, True),
                                                                                tools=template_tools(TOOLS))


def test_only_what_constrains_the_answer_makes_a_grammar() -> None:
    literal = LITERAL
    assert harmony_answer_grammar((), False, None, None, literal) is None
    lark = Constraint("lark", 'start: "x"')
    assert harmony_answer_grammar((), False, lark, None, literal) == Grammar("lark", 'start: "x"')  # applied as it is
    regex = harmony_answer_grammar((), False, Constraint("regex", "[a-z]+/"), None, literal)
    assert regex is not None and "final: " in regex.source and r"/[a-z]+\//" in regex.source
    assert "analysis" not in harmony_grammar(TOOLS, required=True, budget=0, literal=literal).source


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    engine = LocalEngine(make_tiny_binding("qwen3", seed=7, tokenizer=TemplateTokenizer("gpt_oss")), None)
    with TestClient(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB)), raise_server_exceptions=False) as c:
        yield c
    engine.close(30)


def never_end() -> dict[int, float]:
    """A logit bias that has the model start with an analysis ("a", not "final") and never end it
    itself: only the budget ends it."""
    tokenizer = TemplateTokenizer("gpt_oss")
    return {tokenizer.encode("<|end|>")[0]: -100.0, tokenizer.encode("a")[0]: 20.0}


def oracle(grammar: Grammar, tools: tuple[Tool, ...] = TOOLS, biased: bool = True) -> str:
    """The answer `grammar` forces to a prompt that offers `tools`, generated directly (greedy), with
    the analysis never ended by the model (`biased`)."""
    tokenizer = TemplateTokenizer("gpt_oss")
    binding = make_tiny_binding("qwen3", seed=7, tokenizer=tokenizer)
    prompt = encode_chat(tokenizer, chat_messages(tuple(ChatMessage("user", m["content"]) for m in ASK), tools, True),
                         template_tools(tools) or None).tokens
    params = GenerationParams(max_tokens=120, grammar=grammar, sampling=SamplingParams(logit_bias=never_end() if biased else {}))
    result = Generation(binding, prompt, params).run()
    assert result.finish_reason == "stop", result.text
    return result.text


def test_a_forced_call_comes_after_the_analysis_closed_at_its_budget(client: TestClient) -> None:
    match = FORCED.fullmatch(oracle(harmony_grammar(TOOLS[:1], required=True, budget=BUDGET, literal=LITERAL)))
    assert match is not None
    assert len(TemplateTokenizer("gpt_oss").encode(match["reasoning"])) == BUDGET
    jsonschema.validate(json.loads(match["arguments"]), WEATHER)
    body = {"messages": ASK, "max_tokens": 120, "tools": API_TOOLS, "thinking_token_budget": BUDGET,
            "logit_bias": {str(k): v for k, v in never_end().items()},
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == match["reasoning"] and not choice["message"].get("content")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_weather", json.loads(match["arguments"]))]
    events = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    streamed = "".join(e["choices"][0]["delta"].get("reasoning_content") or "" for e in events if e["choices"])
    assert streamed == match["reasoning"]


def test_a_json_answer_comes_in_the_final_channel_after_the_budgeted_analysis(client: TestClient) -> None:
    body = {"messages": ASK, "max_tokens": 120, "thinking_token_budget": BUDGET, "logit_bias": {str(k): v for k, v in never_end().items()},
            "response_format": {"type": "json_schema", "json_schema": {"name": "clock", "schema": CLOCK}}}
    grammar = harmony_answer_grammar((), False, Constraint("json_schema", json.dumps(CLOCK)), BUDGET, LITERAL)
    assert grammar is not None
    text = oracle(grammar, ())
    match = FINAL.fullmatch(text)
    assert match is not None, text
    jsonschema.validate(json.loads(match["text"]), CLOCK)
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert (choice["message"].get("reasoning_content"), choice["message"]["content"]) == (match["reasoning"], match["text"])


@pytest.mark.parametrize("budget", [-1, "8", 1.5, True])
def test_a_bad_thinking_budget_is_a_400_in_openais_shape(client: TestClient, budget: object) -> None:
    response = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "thinking_token_budget": budget})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "thinking_token_budget"


def test_a_responses_call_comes_with_its_analysis_as_a_reasoning_item(client: TestClient) -> None:
    """The Responses API: the analysis (within `reasoning.max_tokens`) is a `reasoning` item, the call a `function_call`."""
    text = oracle(harmony_grammar(TOOLS[:1], required=True, budget=BUDGET, literal=LITERAL), biased=False)
    match = re.fullmatch(r"(?:<\|channel\|>analysis<\|message\|>(?P<reasoning>.*)<\|end\|><\|start\|>assistant)?"
                         + re.escape(CALL_MESSAGE[:CALL_MESSAGE.index("{")]) + r"(?P<arguments>\{.*\})", text, re.DOTALL)
    assert match is not None, text
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": json.loads(t.parameters)} for t in TOOLS]
    response = client.post("/v1/responses", json={"input": ASK[0]["content"], "max_output_tokens": 120, "tools": tools, "store": False,
                                                  "tool_choice": {"type": "function", "name": "get_weather"},
                                                  "reasoning": {"max_tokens": BUDGET}}).json()
    reasoning = [i["summary"][0]["text"] for i in response["output"] if i["type"] == "reasoning"]
    calls = [(i["name"], json.loads(i["arguments"])) for i in response["output"] if i["type"] == "function_call"]
    assert reasoning == ([match["reasoning"]] if match["reasoning"] else [])
    assert calls == [("get_weather", json.loads(match["arguments"]))]


@pytest.mark.parametrize(("field", "effort", "shorter"), [("chat", "high", 2), ("chat", "low", 3), ("responses", "low", 3)])
def test_the_reasoning_effort_reaches_the_template(client: TestClient, field: str, effort: str, shorter: int) -> None:
    """gpt-oss's system prompt says "Reasoning: medium" unless told otherwise: OpenAI chat's
    `reasoning_effort` and Responses' `reasoning.effort` replace the word (one token a byte here)."""
    def prompt_tokens(**extra: Any) -> int:
        if field == "chat":
            usage = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **extra}).json()["usage"]
            return int(usage["prompt_tokens"])
        reasoning = {"reasoning": {"effort": extra["reasoning_effort"]}} if extra else {}
        body = {"input": ASK[0]["content"], "max_output_tokens": 1, "store": False, **reasoning}
        return int(client.post("/v1/responses", json=body).json()["usage"]["input_tokens"])

    assert prompt_tokens(reasoning_effort=effort) == prompt_tokens() - shorter


def test_a_reasoning_effort_that_is_not_text_is_a_400(client: TestClient) -> None:
    got = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, "reasoning_effort": 3})
    assert got.status_code == 400 and got.json()["error"]["param"] == "reasoning_effort"
