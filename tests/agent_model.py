"""A tiny random-weight model that agent clients can talk to: the embedded model's tokenizer and
chat template, a 64k-token context (Claude Code's first request is ~35k tokens), two small
layers, written as an mlx-lm model directory that `mlxkv serve --model DIR` loads.

Its answers are random text, but short: the residual stream carries a constant component that
the final norm keeps alone, and only the EOS row of the (untied) output head reads it, so EOS
has one fixed logit against 0 for every other token. With sampling at temperature 1 about one
token in five is EOS; greedy answers are empty. These models pin protocols and caching, not wit.

    uv run python -m tests.agent_model DIR      # writes DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mlxkv_inference.models.embedded import embedded_model_path  # first: the BLAS shim precedes mlx
from mlxkv_inference.models.gguf import load_gguf
from mlxkv_inference.tokenizer.gguf_tokenizer import GgufTokenizer

import mlx.core as mx  # noqa: E402, I001
from mlx.utils import tree_flatten, tree_unflatten

from mlxkv_inference._mlx_lm import build_model, eval_parameters
from tools.mlx_lm_reference import tokenizer_settings

AGENT_CONTEXT = 65_536
HIDDEN = 64
# EOS logit against 0 for the other 49,151 tokens: P(EOS) = e^9.4 / (e^9.4 + 49151) ~ 0.18 a step.
EOS_LOGIT = 9.4
CARRIER = 256.0  # the constant residual component (dimension 0), large enough to dominate its norm


def agent_model_config(vocab_size: int, eos_id: int, bos_id: int | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": AGENT_CONTEXT,
        "tie_word_embeddings": False,
        "eos_token_id": [eos_id],
    }
    if bos_id is not None:
        config["bos_token_id"] = bos_id
    return config


def write_agent_model(directory: Path, seed: int = 0) -> Path:
    """Write the model into the new directory `directory`; returns it."""
    loaded = load_gguf(embedded_model_path())
    tokenizer = GgufTokenizer(loaded.metadata)
    eos_id = min(tokenizer.eos_token_ids)
    config = agent_model_config(tokenizer.vocab_size, eos_id, tokenizer.bos_token_id)
    model = build_model(config)
    model.update(tree_unflatten(_weights(model, eos_id, seed)))
    eval_parameters(model)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    weights: dict[str, mx.array] = dict(tree_flatten(model.parameters()))  # type: ignore[no-untyped-call]
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    settings = tokenizer_settings(tokenizer, loaded.metadata)
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return directory


def _weights(model: Any, eos_id: int, seed: int) -> list[tuple[str, mx.array]]:
    leaves: Any = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(leaves))
    out = []
    for i, (name, value) in enumerate(leaves):
        if value.ndim >= 2:
            value = mx.random.normal(value.shape, key=keys[i]) * (2.0 / value.shape[-1] ** 0.5)
        if name == "model.embed_tokens.weight":
            value[:, 0] = CARRIER  # every token carries the constant
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            value[0, :] = 0.0  # no layer writes to the carrier dimension
        elif name == "model.norm.weight":
            value = mx.zeros_like(value)
            value[0] = 1.0  # the final norm keeps the carrier alone: always positive
        elif name == "lm_head.weight":
            value = mx.zeros_like(value)
            value[eos_id, 0] = EOS_LOGIT / HIDDEN**0.5  # the normed carrier is about sqrt(HIDDEN)
        out.append((name, value))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="the directory to create")
    print(write_agent_model(parser.parse_args().directory))


if __name__ == "__main__":
    main()
