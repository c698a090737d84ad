"""A reasoning model's think section (`<think>...</think>`: Qwen3, DeepSeek-R1 distills) taken
out of the answer text as it streams, so the APIs can send it apart (`reasoning_content`,
Anthropic `thinking` blocks).

    answer := [<think>] reasoning </think> \\n* text        (the prompt may already hold <think>)

A model is a thinking one when its vocabulary has `<think>` and `</think>` as single tokens; its
answer starts inside the section when the prompt ends with `<think>` (R1 distills' templates put it
there), else when the answer's first text is `<think>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from mlxkv_serve import ToolCall

from mlxkv.engine.harmony import HarmonySplitter
from mlxkv.engine.thinking import ThinkTags
from mlxkv.engine.tool_calls import ToolAnswer, ToolUse

OPEN, CLOSE = "<think>", "</think>"


class _Tokens(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...


class Splitter(Protocol):
    """Splits streamed answer text into (reasoning, text)."""

    def feed(self, piece: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...


# Where a chat answer of a reasoning model starts, known at preparation: "none" (not a chat, or the
# model does not think), "may_open" (the answer may open a think section), "inside" (the prompt did).
ThinkStart = Literal["none", "may_open", "inside"]


def answer_splitter(tools: ToolUse, chat: bool, think: ThinkStart) -> Splitter:
    """How a chat answer's reasoning is told apart: harmony channels (gpt-oss) or a think section
    (`think`: where the answer starts as to it, recorded when the request was prepared)."""
    if chat and tools.format.name == "harmony":
        return HarmonySplitter()
    return ThinkSplitter(think != "none", think == "inside")


def think_tags(tokenizer: _Tokens) -> ThinkTags | None:
    """The model's think tags, or None for a model that does not think."""
    open_ids = tokenizer.encode(OPEN, add_special_tokens=False)
    close_ids = tokenizer.encode(CLOSE, add_special_tokens=False)
    if len(open_ids) != 1 or len(close_ids) != 1:
        return None
    return ThinkTags(open_ids[0], close_ids[0])


def starts_thinking(tags: ThinkTags | None, prompt: Sequence[int]) -> bool:
    """Whether the prompt opened the think section (its last tokens hold `<think>`)."""
    return tags is not None and tags.open_id in prompt[-3:] and tags.close_id not in prompt[-3:]


class ThinkSplitter:
    """Splits streamed answer text into (reasoning, text); a tag cut between two pieces is held."""

    def __init__(self, thinking: bool, inside: bool) -> None:
        self._state = ("inside" if inside else "start") if thinking else "text"
        self._held = ""
        self.reasoning = ""  # all of it so far

    def feed(self, piece: str) -> tuple[str, str]:
        if self._state == "text":
            return "", piece
        self._held += piece
        if self._state == "start":
            stripped = self._held.lstrip()
            if OPEN.startswith(stripped):
                return "", ""  # maybe the tag, not whole yet
            if not stripped.startswith(OPEN):
                self._state, text, self._held = "text", self._held, ""
                return "", text
            self._state, self._held = "inside", stripped[len(OPEN):]
        if self._state == "inside":
            return self._inside()
        return self._after()

    def finish(self) -> tuple[str, str]:
        """What is still held: reasoning cut by max_tokens, or text."""
        held, self._held = self._held, ""
        if self._state == "inside":
            self.reasoning += held
            return held, ""
        return "", held

    def _inside(self) -> tuple[str, str]:
        end = self._held.find(CLOSE)
        if end < 0:
            keep = _partial_tag(self._held, CLOSE)
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
            self.reasoning += out
            return out, ""
        out, self._held = self._held[:end], self._held[end + len(CLOSE):]
        self.reasoning += out
        self._state = "after"
        _, text = self._after()
        return out, text

    def _after(self) -> tuple[str, str]:
        """The text after the section, without the newlines that separate it."""
        stripped = self._held.lstrip("\n")
        if not stripped:
            return "", ""
        self._state, self._held = "text", ""
        return "", stripped


class AnswerStream:
    """An answer as it streams: its think section apart, then its text or tool calls."""

    def __init__(self, splitter: Splitter, tools: ToolAnswer) -> None:
        self._splitter = splitter
        self._tools = tools
        self._text = ""

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, text) of `piece` that can be sent now."""
        reasoning, text = self._splitter.feed(piece)
        self._text += text
        return reasoning, self._tools.feed(text) if text else ""

    def finish(self) -> tuple[str, str, tuple[ToolCall, ...]]:
        """(reasoning, text) still to send, and the answer's calls."""
        reasoning, text = self._splitter.finish()
        self._text += text
        sent = self._tools.feed(text) if text else ""
        rest, calls = self._tools.finish(self._text)
        return reasoning, sent + rest, calls


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
