"""A reasoning model's think section sent apart from its answer: the splitter on its own, then a
tiny random-weight model whose template opens the section (as DeepSeek-R1 distills' do), through
`reasoning_content` (OpenAI chat) and `thinking` blocks (Anthropic), against the raw completion."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import pytest
from starlette.testclient import TestClient

from mlxkv.engine.local_engine import LocalEngine
from mlxkv.engine.reasoning import AnswerStream, ThinkSplitter, starts_thinking, think_tags
from mlxkv.engine.tool_calls import ToolAnswer, ToolUse
from mlxkv_inference import Message
from mlxkv_serve import ServeConfig, Tool, build_app
from tests.factories import EOS_ID, ByteTokenizer, make_tiny_binding

OPEN_ID, CLOSE_ID = EOS_ID + 1, EOS_ID + 2


class ThinkingByteTokenizer(ByteTokenizer):
    """The byte tokenizer with `<think>` and `</think>` as tokens and an R1-style template."""

    def __init__(self) -> None:
        super().__init__()
        self.backend.add_special_tokens(["<think>", "</think>"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.backend.decode([i for i in ids if i <= CLOSE_ID], skip_special_tokens=False))

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                            tools: Sequence[Message] | None = None, enable_thinking: bool | None = None,
                            reasoning_effort: str | None = None) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant><think>\n" if add_generation_prompt else "")


def split(pieces: list[str], *, thinking: bool = True, inside: bool = False) -> tuple[str, str]:
    splitter = ThinkSplitter(thinking, inside)
    out = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    return "".join(r for r, _ in out), "".join(t for _, t in out)


def test_the_think_section_is_split_out_even_when_its_tags_are_cut() -> None:
    assert split(["<th", "ink>abc</th", "ink>\n\nHel", "lo"]) == ("abc", "Hello")
    assert split(["  <think>a<b</think>x"]) == ("a<b", "x")
    assert split(["abc</think>\n\nhi"], inside=True) == ("abc", "hi")
    assert split(["still thinking </thi"], inside=True) == ("still thinking </thi", "")  # cut by max_tokens
    assert split(["Hello <think>"]) == ("", "Hello <think>")
    assert split(["<think>x</think>y"], thinking=False) == ("", "<think>x</think>y")


def test_tool_calls_after_the_think_section_are_parsed() -> None:
    tools = (Tool("f", "", json.dumps({"type": "object"})),)
    answer = AnswerStream(ThinkSplitter(True, True), ToolAnswer(ToolUse(tools, tools), "g"))
    pieces = ["plan</think>\n\n<tool_", 'call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>']
    fed = [answer.feed(p) for p in pieces]
    reasoning, rest, calls = answer.finish()
    assert "".join(r for r, _ in fed) + reasoning == "plan" and "".join(t for _, t in fed) + rest == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]


def test_think_tags_are_found_in_a_thinking_vocabulary_only() -> None:
    tags = think_tags(ThinkingByteTokenizer())
    assert tags is not None and (tags.open_id, tags.close_id) == (OPEN_ID, CLOSE_ID)
    assert think_tags(ByteTokenizer()) is None
    assert starts_thinking(tags, [5, OPEN_ID, 10]) and not starts_thinking(tags, [OPEN_ID, 9, CLOSE_ID])


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    binding = make_tiny_binding("qwen3", seed=3, tokenizer=ThinkingByteTokenizer())
    engine = LocalEngine(binding, None)
    with TestClient(build_app(engine, ServeConfig(vocab_size=binding.tokenizer.vocab_size)), raise_server_exceptions=False) as c:
        yield c
    engine.close(30)


def raw_split(client: TestClient, max_tokens: int) -> tuple[str, str]:
    """The oracle: the raw completion of the same prompt text, split at its first `</think>`."""
    raw = client.post("/v1/completions", json={"prompt": "<user>Hi\n<assistant><think>\n", "max_tokens": max_tokens})
    assert raw.status_code == 200, raw.text
    text: str = raw.json()["choices"][0]["text"]
    reasoning, closed, after = text.partition("</think>")
    return reasoning, after.lstrip("\n") if closed else ""


@pytest.mark.parametrize("max_tokens", [12, 40])
def test_reasoning_content_is_the_think_section_of_the_raw_answer(client: TestClient, max_tokens: int) -> None:
    expected = raw_split(client, max_tokens)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message.get("reasoning_content", ""), message["content"]) == expected
    assert expected[0]  # the tiny model thinks at least one character
    frames = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    deltas = [f["choices"][0]["delta"] for f in frames if f["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == expected[0]
    assert "".join(d.get("content", "") for d in deltas) == expected[1]


def test_anthropic_thinking_blocks_carry_the_think_section(client: TestClient) -> None:
    reasoning, text = raw_split(client, 12)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12}
    content = client.post("/v1/messages", json=body).json()["content"]
    assert content[0]["type"] == "thinking" and content[0]["thinking"] == reasoning and content[0]["signature"]
    assert content[1:] == [{"type": "text", "text": text}]
    frames = [json.loads(line[6:]) for line in client.post("/v1/messages", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: ")]
    deltas = [f["delta"] for f in frames if f["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == reasoning
    assert [d["signature"] for d in deltas if d["type"] == "signature_delta"] == [content[0]["signature"]]
    assert frames[2]["content_block"]["type"] == "thinking" and frames[2]["index"] == 0
