"""Tool-call formats per model family: how an answer's calls look, the Lark rules that force them
to match the tools' schemas, and their parser.

    hermes       <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>   Qwen2.5/3, Hermes (and the fallback)
    qwen3_coder  <tool_call>\\n<function=N>\\n<parameter=P>\\nV\\n</parameter>\\n</function>\\n</tool_call>
    llama3_json  {"name": N, "parameters": {...}}                                Llama 3.1-3.3
    mistral      [TOOL_CALLS][{"name": N, "arguments": {...}}]                  Mistral v3 tokenizers (7B v0.3: "] [")
    mistral      [TOOL_CALLS]N[ARGS]{...}                                       Mistral v11+ ([ARGS] in the vocabulary)
    harmony      <|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}   gpt-oss (see `harmony`)
    gemma4       <|tool_call>call:N{key:<|"|>text<|"|>,n:5}<tool_call|>         Gemma 4 (see `gemma_tools`)

The format is chosen from the chat template's source (the markers mlx-lm's `_infer_tool_parser`
looks for) and the vocabulary. A marker that is one token of the vocabulary is written in the
grammar as that token (`<[id]>`, for an added token), so the model is forced the token it was
trained on, not its spelling in bytes. Parsing uses mlx-lm's parsers where they fit (qwen3_coder, mistral, gemma4); the JSON
formats are parsed here (mlx-lm's json_tools is `json.loads`, and it has no Llama 3 parser).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from mlxkv_serve import Tool

from mlxkv.engine import _mlx_lm_tools
from mlxkv.engine.gemma_tools import gemma4_rules
from mlxkv.engine.harmony import CALL_START, MarkerLark, Parsed, is_harmony, json_rule, parse_harmony_calls


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's call format: `start` is the text every call answer begins with (free text never
    does), `rules(tools, parallel)` the Lark lines that define the rule `calls`."""

    name: str
    start: str
    literal: MarkerLark
    gap: str = ""  # what the template writes between the call marker and the calls (Mistral 7B v0.3: " ")

    def rules(self, tools: Sequence[Tool], parallel: bool) -> list[str]:
        return _RULES[self.name](self, tools, parallel)

    def parse(self, text: str, tools: Sequence[Tool]) -> list[Parsed]:
        """The well-formed calls in `text` (an answer of the call branch), in order."""
        return _PARSERS[self.name](self, text, tools)

    @property
    def start_is_token(self) -> bool:
        """Whether calls start with a marker token (text never produces it), not spelled-out text."""
        return self.literal(self.start).startswith("<[")

    def text_rule(self) -> str:
        """Free text: not starting with a newline, nor with the call marker's first character
        when that marker is spelled in text (a marker token cannot be produced by text)."""
        first = self.start[0]
        excluded = "\\n" if self.start_is_token or first == "\n" else f"\\n{re.escape(first)}".replace("/", "\\/")
        return f"TEXT: /[^{excluded}](.|\\n)*/"


def detect_tool_format(template: str, vocab: Collection[str], literal: MarkerLark) -> ToolFormat:
    """The call format of a model whose chat template source is `template` and whose vocabulary
    holds the added tokens `vocab`; Hermes when nothing more specific is found."""
    if is_harmony(template):
        return ToolFormat("harmony", CALL_START, literal)
    if "<|tool_call>" in template and "<tool_call|>" in template:
        return ToolFormat("gemma4", "<|tool_call>", literal)
    if "<tool_call>\n<function=" in template or "<tool_call>\\n<function=" in template:
        return ToolFormat("qwen3_coder", "<tool_call>", literal)
    if "[TOOL_CALLS]" in template or "[TOOL_CALLS]" in vocab:
        header = "[ARGS]" in template or "[ARGS]" in vocab
        return ToolFormat("mistral_args" if header else "mistral", "[TOOL_CALLS]", literal, " " if "[TOOL_CALLS] [" in template else "")
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters": ' in template):
        return ToolFormat("llama3_json", "{", literal)
    return ToolFormat("hermes", "<tool_call>", literal)


def model_tool_format(tokenizer: object) -> ToolFormat:
    """The call format of the model whose tokenizer is `tokenizer` (its `chat_template` source and
    its `backend` vocabulary, where it has them)."""
    template = getattr(tokenizer, "chat_template", None)
    backend = getattr(tokenizer, "backend", None)
    # Markers are added tokens (special or not): a byte-level vocabulary's "{" is no marker.
    added = {str(t.content): int(i) for i, t in backend.get_added_tokens_decoder().items()} if backend is not None else {}
    return detect_tool_format(template if isinstance(template, str) else "", added, token_literal(added.get))


def token_literal(token_ids: Callable[[str], int | None]) -> MarkerLark:
    """A `MarkerLark` that writes a marker as its token when `token_ids(marker)` finds one."""

    def literal(text: str) -> str:
        token = token_ids(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    return literal


def hermes_format() -> ToolFormat:
    """The format of templates that do not render tools (their tools are described in the prompt)."""
    return ToolFormat("hermes", "<tool_call>", json.dumps)


_json = json_rule


def _call_schemas(tools: Sequence[Tool], arguments_key: str) -> dict[str, Any]:
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, arguments_key: json.loads(t.parameters)},
                       "required": ["name", arguments_key], "additionalProperties": False} for t in tools]}


def _hermes_rules(fmt: ToolFormat, tools: Sequence[Tool], parallel: bool) -> list[str]:
    open_, close = fmt.literal("<tool_call>"), fmt.literal("</tool_call>")
    return ['calls: call ("\\n" call)*' if parallel else "calls: call",
            f'call: {open_} "\\n" body "\\n" {close}', f"body: {_json(_call_schemas(tools, 'arguments'))}"]


def _qwen3_coder_rules(fmt: ToolFormat, tools: Sequence[Tool], parallel: bool) -> list[str]:
    open_, close = fmt.literal("<tool_call>"), fmt.literal("</tool_call>")
    lines = ['calls: call ("\\n" call)*' if parallel else "calls: call",
             f'call: {open_} "\\n" ({" | ".join(f"fn{i}" for i in range(len(tools)))}) "\\n" {close}',
             r"RAW: /(.|\n)*/ & ~/(.|\n)*\n<\/parameter>(.|\n)*/"]
    for i, tool in enumerate(tools):
        schema = json.loads(tool.parameters)
        required = set(schema.get("required", ()))
        params = []
        for j, (name, prop) in enumerate(schema.get("properties", {}).items()):
            lines.append(f'fn{i}p{j}: {json.dumps(f"<parameter={name}>")} "\\n" {_xml_value(prop)} "\\n</parameter>\\n"')
            params.append(f"fn{i}p{j}" if name in required else f"fn{i}p{j}?")
        lines.append(f'fn{i}: {json.dumps(f"<function={tool.name}>")} "\\n" {" ".join(params)} "</function>"')
    return lines


def _xml_value(prop: dict[str, Any]) -> str:
    """A Qwen3-Coder parameter value: a string raw (within its maxLength; an enum's one of its
    values), else JSON."""
    if prop.get("type") == "string" and "enum" not in prop and "pattern" not in prop and "format" not in prop:
        if isinstance(prop.get("maxLength"), int):
            return f"/(.|\\n){{0,{prop['maxLength']}}}/"
        return "RAW"
    if "enum" in prop and all(isinstance(v, str) for v in prop["enum"]):
        return "(" + " | ".join(json.dumps(v) for v in prop["enum"]) + ")"
    return _json(prop)


def _llama3_rules(fmt: ToolFormat, tools: Sequence[Tool], parallel: bool) -> list[str]:
    return [f"calls: {_json(_call_schemas(tools, 'parameters'))}"]  # Llama 3 JSON calls one tool an answer


def _mistral_rules(fmt: ToolFormat, tools: Sequence[Tool], parallel: bool) -> list[str]:
    more = ' (", " call)*' if parallel else ""
    return [f'calls: {fmt.literal("[TOOL_CALLS]")} {json.dumps(fmt.gap + "[")} call{more} "]"', f"call: {_json(_call_schemas(tools, 'arguments'))}"]


def _mistral_args_rules(fmt: ToolFormat, tools: Sequence[Tool], parallel: bool) -> list[str]:
    marker, args = fmt.literal("[TOOL_CALLS]"), fmt.literal("[ARGS]")
    lines = ["calls: call+" if parallel else "calls: call", f'call: {marker} ({" | ".join(f"fn{i}" for i in range(len(tools)))})']
    lines += [f"fn{i}: {json.dumps(t.name)} {args} {_json(json.loads(t.parameters))}" for i, t in enumerate(tools)]
    return lines


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _hermes_parse(fmt: ToolFormat, text: str, tools: Sequence[Tool]) -> list[Parsed]:
    return [call for match in _CALL.finditer(text) if (call := _json_call(match.group(1), "arguments")) is not None]


def _qwen3_coder_parse(fmt: ToolFormat, text: str, tools: Sequence[Tool]) -> list[Parsed]:
    specs = [{"type": "function", "function": {"name": t.name, "parameters": json.loads(t.parameters)}} for t in tools]
    return [call for match in _CALL.finditer(text) if (call := _mlx_lm_tools.parse("qwen3_coder", match.group(1), specs))]


def _llama3_parse(fmt: ToolFormat, text: str, tools: Sequence[Tool]) -> list[Parsed]:
    call = _json_call(text.strip(), "parameters")
    return [call] if call is not None else []


def _mistral_parse(fmt: ToolFormat, text: str, tools: Sequence[Tool]) -> list[Parsed]:
    body = text.removeprefix("[TOOL_CALLS]")
    if fmt.name == "mistral_args":  # mlx-lm reads one "[TOOL_CALLS]"-free run of name[ARGS]{...}, without ids
        body = re.sub(r"\[CALL_ID\][\w-]*", "", body.replace("[TOOL_CALLS]", ""))
    return _mlx_lm_tools.parse_all("mistral", body)


def _json_call(text: str, arguments_key: str) -> Parsed | None:
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get(arguments_key), dict):
        return call["name"], call[arguments_key]
    return None


_RULES: dict[str, Callable[[ToolFormat, Sequence[Tool], bool], list[str]]] = {
    "hermes": _hermes_rules, "qwen3_coder": _qwen3_coder_rules, "llama3_json": _llama3_rules,
    "mistral": _mistral_rules, "mistral_args": _mistral_args_rules,
    "gemma4": lambda fmt, tools, parallel: gemma4_rules(fmt.literal, tools, parallel),
}
_PARSERS: dict[str, Callable[[ToolFormat, str, Sequence[Tool]], list[Parsed]]] = {
    "hermes": _hermes_parse, "qwen3_coder": _qwen3_coder_parse, "llama3_json": _llama3_parse,
    "mistral": _mistral_parse, "mistral_args": _mistral_parse,
    "harmony": lambda fmt, text, tools: parse_harmony_calls(text),
    "gemma4": lambda fmt, text, tools: _mlx_lm_tools.parse_all("gemma4", text),
}
