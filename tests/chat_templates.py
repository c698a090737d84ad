"""Test tokenizers that carry a model family's chat template (tests/fixtures/chat_templates/) and the
family's marker tokens, over the byte-level tokenizer of `tests.factories`."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from mlxkv_inference import Message
from mlxkv_inference.tokenizer.chat_template import render_chat_template
from tests.factories import EOS_ID, ByteTokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

# Each family's template and the markers its vocabulary holds as single tokens.
FAMILIES: dict[str, tuple[str, ...]] = {
    "qwen3": ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"),
    "qwen3_coder": ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
    "llama3_1": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
    "mistral_nemo": ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                     "[/TOOL_RESULTS]"),
    "mistral_small_3_2": ("[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                          "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
    "gemma4": ("<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>",
               "<tool_response|>", "<|channel>", "<channel|>", "<|think|>"),
    "gpt_oss": ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"),
}
# Markers that end an answer, as the family's generation config lists them (beside <eos>).
EOS_MARKERS: dict[str, tuple[str, ...]] = {"gpt_oss": ("<|return|>", "<|call|>")}


class TemplateTokenizer(ByteTokenizer):
    """The byte tokenizer with `family`'s chat template, its markers as tokens from id 257 on."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        markers = FAMILIES[family]
        self.backend.add_tokens(list(markers))
        self._last_id = EOS_ID + len(markers)
        self._template = (TEMPLATES / f"{family}.jinja").read_text()
        self._eos = frozenset({EOS_ID, *(EOS_ID + 1 + markers.index(m) for m in EOS_MARKERS.get(family, ()))})

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def chat_template(self) -> str:
        return self._template

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.backend.decode([i for i in ids if i <= self._last_id], skip_special_tokens=False))

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                            tools: Sequence[Message] | None = None, enable_thinking: bool | None = None,
                            reasoning_effort: str | None = None) -> str:
        extra: dict[str, object] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        if reasoning_effort is not None:
            extra["reasoning_effort"] = reasoning_effort
        return render_chat_template(self._template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=[dict(t) for t in tools] if tools else None, bos_token="", eos_token="<eos>", **extra)

    def content_hash(self) -> str:
        return hashlib.sha256((super().content_hash() + self._template).encode()).hexdigest()
