"""gpt-oss harmony answers: the channels an answer is written in, their grammar, and its calls.

    answer   := [analysis <|start|>assistant] (final | call)      (the prompt ends with <|start|>assistant)
    analysis := <|channel|>analysis<|message|> reasoning <|end|>
    final    := <|channel|>final<|message|> text                  <|return|> ends it (an EOS token)
    call     := <|channel|>commentary to=functions.NAME <|constrain|>json<|message|> {arguments} <|call|>

The analysis channel is the answer's reasoning (`reasoning_content`, Anthropic `thinking` blocks,
Responses `reasoning` items); the final channel its text. A call ends the answer (`<|call|>` is an
EOS token), so an answer holds one call; a history with several calls in one assistant turn is
rendered as one turn a call, each followed by its result, as harmony writes them.

mlx-lm 0.32.2 has no harmony parser; OpenAI's `openai-harmony` renders and parses token ids of its
own tokenizer, which it downloads on first use (no offline install), so the format is read here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from mlxkv_inference import Grammar
from mlxkv_inference.generation.constraint import JSON_LAYOUT
from mlxkv_serve import ChatMessage, Constraint, Tool

MarkerLark = Callable[[str], str]  # marker text -> its Lark form (a token reference or a quoted string)
Parsed = tuple[str, dict[str, Any]]  # (tool name, arguments)

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL_START = f"{CHANNEL}commentary to=functions."
# Where a message's body ends: its end tokens (<|return|> and <|call|> are EOS: rarely in the text), or the next message.
_BODY_ENDS = (END, "<|call|>", "<|return|>", START)
# A message header: [<|start|>role] [ to=R] <|channel|>CH [ to=R] [ <|constrain|>T | T]<|message|>
_HEADER = re.compile(r"(?:<\|start\|>[^<\s]*)?(?: to=(?P<pre>\S+?))?<\|channel\|>(?P<channel>[a-z]+)"
                     r"(?: to=(?P<to>\S+?))?\s*(?:<\|constrain\|>)?\s*(?:[a-z]+)?<\|message\|>")


def is_harmony(template: str) -> bool:
    """Whether a chat template writes harmony messages (gpt-oss)."""
    return CHANNEL in template and f"{START}assistant" in template


def harmony_grammar(tools: Sequence[Tool], *, required: bool, budget: int | None, literal: MarkerLark,
                    final: str = "TEXT") -> Grammar:
    """[analysis within `budget` tokens (0: none)] then the final channel or a call of `tools`;
    `final`: the final message's rule (a user's `%json` grammar, or free text)."""
    ch, msg = literal(CHANNEL), literal(MESSAGE)
    answers = [b for b, on in (("final", not required), ("call", bool(tools))) if on]
    lines = [f"start: {'analysis? ' if budget != 0 else ''}({' | '.join(answers)})",
             f'final: {ch} "final" {msg} {final}', r"TEXT: /(.|\n)*/"]
    if budget != 0:
        limit = f"[max_tokens={budget}]" if budget is not None else ""
        lines += [f'analysis: {ch} "analysis" {msg} reasoning {literal(END)} {literal(START)} "assistant"',
                  f"reasoning{limit}: /(.|\\n)*/"]
    if tools:
        lines.append(f'call: {ch} "commentary to=functions." ({" | ".join(f"fn{i}" for i in range(len(tools)))})')
        lines += [f'fn{i}: {json.dumps(t.name)} " " {literal(CONSTRAIN)} "json" {msg} {json_rule(json.loads(t.parameters))}'
                  for i, t in enumerate(tools)]
    return Grammar("lark", "\n".join(lines) + "\n")


def harmony_answer_grammar(tools: Sequence[Tool], required: bool, constraint: Constraint | None, budget: int | None,
                           literal: MarkerLark) -> Grammar | None:
    """An answer's grammar on a harmony model: calls of `tools`, or a final message that matches
    the user's JSON schema or regex, each after an analysis within `budget`; None where nothing
    constrains it. A Lark constraint is applied as it is (its own `start`: the channels are its to write)."""
    if constraint is not None and constraint.kind == "lark":
        return Grammar(constraint.kind, constraint.source)
    if not tools and constraint is None and budget is None:
        return None
    final = "TEXT"
    if constraint is not None:
        final = json_rule(json.loads(constraint.source)) if constraint.kind == "json_schema" else regex_rule(constraint.source)
    return harmony_grammar(tools, required=required, budget=budget, literal=literal, final=final)


def regex_rule(regex: str) -> str:
    """A Lark rule body that matches `regex`."""
    return "/" + regex.replace("/", "\\/") + "/"


def json_rule(schema: Any) -> str:
    """A Lark rule body that is JSON matching `schema`, laid out as `json.dumps` does."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {schema!r:.80}")
    return f"%json {json.dumps({'x-guidance': JSON_LAYOUT, **schema})}"


def parse_harmony_calls(text: str) -> list[Parsed]:
    """The call a harmony answer's call message holds (`CALL_START` NAME ... <|message|>{...})."""
    header = _HEADER.match(text)
    recipient = header and (header.group("to") or header.group("pre"))
    if header is None or not recipient or not recipient.startswith("functions."):
        return []
    try:
        arguments = json.loads(_cut_body(text[header.end():]))
    except json.JSONDecodeError:
        return []
    return [(recipient.removeprefix("functions."), arguments)] if isinstance(arguments, dict) else []


def harmony_history(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """`messages` with each assistant turn of several calls split into one turn a call, each call
    followed by its result (the gpt-oss template renders only a turn's first call)."""
    out: list[ChatMessage] = []
    results = {m.tool_call_id: m for m in messages if m.role == "tool" and m.tool_call_id is not None}
    answered: set[str] = set()
    for m in messages:
        if m.role == "tool" and m.tool_call_id in answered:
            continue
        if m.role != "assistant" or len(m.tool_calls) < 2:
            out.append(m)
            continue
        for i, call in enumerate(m.tool_calls):
            out.append(ChatMessage("assistant", m.content if i == 0 else "", tool_calls=(call,), reasoning=m.reasoning if i == 0 else ""))
            if call.id in results and i < len(m.tool_calls) - 1:
                out.append(results[call.id])
                answered.add(call.id)
    return out


class HarmonySplitter:
    """Splits a streamed harmony answer into (reasoning, text): the analysis channel is reasoning,
    the final channel (and a commentary preamble) text; a call message is passed on as text from
    `CALL_START` on, for the tool-call reader. An answer that writes no channels is text."""

    def __init__(self) -> None:
        self._held = ""
        self._kind: str | None = None  # None: reading a header; "reasoning" | "text" | "plain"
        self.reasoning = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self._held += piece
        reasoning, text = "", ""
        while self._held:
            if self._kind is None and not self._header():
                break
            r, t, more = self._body()
            reasoning, text = reasoning + r, text + t
            if not more:
                break
        self.reasoning += reasoning
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What is still held: the rest of a body cut by max_tokens (a header cut short is dropped)."""
        held, self._held = self._held, ""
        if self._kind == "reasoning":
            self.reasoning += held
            return held, ""
        return ("", held) if self._kind is not None else ("", "")

    def _header(self) -> bool:
        """Reads a whole message header, if held; False while it is not whole yet."""
        match = _HEADER.match(self._held)
        if match is None:
            if not any(m.startswith(self._held[:len(m)]) for m in (START, CHANNEL, " to=")) or len(self._held) > 256:
                self._kind = "plain"  # no channels: the model answers in plain text
                return True
            return False
        recipient = match.group("to") or match.group("pre") or ""
        channel = match.group("channel")
        self._held = self._held[match.end():]
        if recipient.startswith("functions."):
            self._kind, self._held = "text", f"{CALL_START}{recipient.removeprefix('functions.')} {CONSTRAIN}json{MESSAGE}{self._held}"
        else:
            self._kind = "reasoning" if channel == "analysis" else "text"
        return True

    def _body(self) -> tuple[str, str, bool]:
        """(reasoning, text) of the body held so far, and whether a next header may follow."""
        if self._kind == "plain":
            out, self._held = self._held, ""
            return "", out, False
        kind = self._kind
        cut = min((i for i in (self._held.find(e) for e in _BODY_ENDS) if i >= 0), default=-1)
        if cut < 0:
            keep = max(_partial(self._held, e) for e in _BODY_ENDS)
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            more = False
        else:
            out = self._held[:cut]
            self._held = self._held[cut:].removeprefix(END).removeprefix("<|call|>").removeprefix("<|return|>")
            self._kind, more = None, True
        return (out, "", more) if kind == "reasoning" else ("", out, more)


def _cut_body(body: str) -> str:
    cut = min((i for i in (body.find(e) for e in _BODY_ENDS) if i >= 0), default=len(body))
    return body[:cut]


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
