"""Factories for tests: tiny random-weight mlx-lm models with a real byte-level tokenizer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mlxkv_inference import KvScheme, Message, MlxAutoregressiveBinding
from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.tokenizer.chat_template import render_chat_template
from mlx.utils import tree_flatten, tree_unflatten

from mlxkv_inference._mlx_lm import build_model, eval_parameters

TINY_VOCAB = 320
EOS_ID = 256

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": TINY_VOCAB,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "qwen3": {"model_type": "qwen3"},
    # Sliding-window layers (window 8) alternate with global ones: prompts run past the window.
    "gemma3_text": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 16,
    },
    # Hybrid: linear-attention (recurrent) layers with one full-attention layer every 2.
    "qwen3_next": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "partial_rotary_factor": 0.5,
        "tie_word_embeddings": False,
    },
}


class ByteTokenizer:
    """A real byte-level tokenizer (256 byte tokens + specials) built with `tokenizers`."""

    def __init__(self) -> None:
        byte_tokens = pre_tokenizers.ByteLevel.alphabet()
        vocab = {tok: i for i, tok in enumerate(sorted(byte_tokens))}
        self._tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self._tok.add_special_tokens(["<eos>"])

    @property
    def backend(self) -> Tokenizer:
        return self._tok

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS_ID})

    @property
    def vocab_size(self) -> int:
        return TINY_VOCAB

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([i for i in ids if i <= EOS_ID], skip_special_tokens=False))

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, tools: Sequence[Message] | None = None,
        enable_thinking: bool | None = None, reasoning_effort: str | None = None,
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def content_hash(self) -> str:
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()


# Qwen2.5's tool-calling layout (Hermes `<tool_call>` JSON), cut down to what the tests exercise.
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}"
    "\n\n# Tools\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:"
    "\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}{% for tc in m.tool_calls %}\n<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class QwenStyleByteTokenizer(ByteTokenizer):
    """The byte tokenizer with a chat template that takes `tools` (Qwen/Hermes style)."""

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, tools: Sequence[Message] | None = None,
        enable_thinking: bool | None = None, reasoning_effort: str | None = None,
    ) -> str:
        return render_chat_template(QWEN_TOOLS_TEMPLATE, messages, add_generation_prompt=add_generation_prompt,
                                    tools=[dict(t) for t in tools] if tools else None)

    def content_hash(self) -> str:
        return hashlib.sha256((super().content_hash() + QWEN_TOOLS_TEMPLATE).encode()).hexdigest()


def make_tiny_config(kind: str, **overrides: Any) -> dict[str, Any]:
    return {**_BASE, **TINY_CONFIGS[kind], **overrides}


def make_tiny_binding(
    kind: str, *, seed: int = 0, kv_scheme: KvScheme = KvScheme(),
    binding_class: type[MlxAutoregressiveBinding] = MlxAutoregressiveBinding, tokenizer: ByteTokenizer | None = None,
    native: bool = False, **overrides: Any,
) -> MlxAutoregressiveBinding:
    """A random-weight model of mlx-lm's `kind` class, fixed by `seed` (bound by `binding_class`, a subclass for tests
    that need a component that stalls or fails). `native`: the server's path, weights quantized to 4 bits and run by
    mlxkv's native matmul and attention kernels."""
    config = make_tiny_config(kind, **overrides)
    mx.random.seed(seed)
    model = build_model(config)
    _randomize(model, seed)
    if native:
        nn.quantize(model, group_size=32, bits=4)
    eval_parameters(model)
    model.eval()
    return binding_class(
        model, tokenizer or ByteTokenizer(), model_id=f"tiny-{kind}", config=config, kv_scheme=kv_scheme,
        weights_digest=str(seed), cpu_kernels="native" if native else "mlx",
    )


def make_prompt(length: int, seed: int = 1) -> list[int]:
    """Deterministic prompt ids below the byte range (so any id decodes)."""
    values = mx.random.randint(0, 256, (length,), key=mx.random.key(seed))
    return [int(v) for v in values.tolist()]  # type: ignore[union-attr, arg-type]


def _randomize(model: Any, seed: int) -> None:
    """Re-draw every matrix with std 2/sqrt(fan_in): default inits give near-constant greedy output."""
    leaves: Any = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(leaves))
    fresh = [
        (name, mx.random.normal(v.shape, key=keys[i]) * (2.0 / v.shape[-1] ** 0.5) if v.ndim >= 2 else v)
        for i, (name, v) in enumerate(leaves)
    ]
    model.update(tree_unflatten(fresh))


def greedy_token(logits: mx.array) -> int:
    value = mx.argmax(logits, axis=-1).item()
    assert isinstance(value, int)
    return value


def make_identity(binding: MlxAutoregressiveBinding) -> Any:
    from mlxkv_ssd_cache import KvIdentity

    return KvIdentity(binding.model_id, binding.tokenizer_hash, binding.config_fingerprint)


def make_plain_caches(num_tokens: int, layers: int = 2, seed: int = 0, dtype: mx.Dtype = mx.float32) -> list[PlainKVCache]:
    """Model-free plain KV caches holding `num_tokens` random tokens (for store tests)."""
    caches = []
    for layer in range(layers):
        cache = PlainKVCache()
        if num_tokens:
            k = mx.random.normal((1, 2, num_tokens, 32), key=mx.random.key(seed * 100 + layer)).astype(dtype)
            cache.update_and_fetch(k, -k)
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


def count_fed_tokens(binding: MlxAutoregressiveBinding, monkeypatch: Any) -> list[int]:
    """The token counts of `binding.feed` calls from now on (every prefill chunk, every feed
    outside one-token decode steps), appended to the list returned."""
    fed: list[int] = []
    feed = binding.feed

    def counted(tokens: Sequence[int], caches: list[Any], interrupt: Any = None) -> int:
        fed.append(len(tokens))
        return feed(tokens, caches, interrupt)

    monkeypatch.setattr(binding, "feed", counted)
    return fed


def count_graph_forwards(binding: MlxAutoregressiveBinding, method: str, monkeypatch: Any) -> list[int]:
    """The positions each call of `binding.<method>` (`decode`: uncompiled single steps,
    `decode_positions`: uncompiled rounds) fed from now on, appended to the list returned."""
    sizes: list[int] = []
    forward = getattr(binding, method)

    def counted(tokens: mx.array, caches: list[Any]) -> mx.array:
        sizes.append(tokens.size)
        logits: mx.array = forward(tokens, caches)
        return logits

    monkeypatch.setattr(binding, method, counted)
    return sizes


def save_mlx_lm_directory(binding: MlxAutoregressiveBinding, directory: Path) -> Path:
    """A tiny model as an mlx-lm directory (config, weights, tokenizer); returns the directory."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(binding.config))
    weights: dict[str, mx.array] = dict(tree_flatten(binding.model.parameters()))  # type: ignore[no-untyped-call]
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    tokenizer = binding.tokenizer
    assert isinstance(tokenizer, ByteTokenizer)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}))
    return directory
