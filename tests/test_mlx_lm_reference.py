"""The embedded model written out as an mlx-lm directory (the bench's mlx_lm.server reference) is the
same model: mlx-lm's own loader and tokenizer give the same chat prompt ids and the same greedy tokens,
ending at the same EOS, as mlxkv on MLX's kernels. Real weights."""

from __future__ import annotations

import json
from pathlib import Path

from mlxkv_inference import GenerationParams, MlxAutoregressiveBinding
from mlxkv_inference._mlx_lm import load_directory, mlx_lm_stream_tokens
from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.tokenizer.chat import encode_chat
from tools.mlx_lm_reference import write_mlx_lm_directory

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_embedded_model_as_mlx_lm_directory_generates_what_mlxkv_does(embedded: MlxAutoregressiveBinding, tmp_path: Path) -> None:
    directory = write_mlx_lm_directory(tmp_path / "smollm2")
    quantization = json.loads((directory / "config.json").read_text())["quantization"]
    assert quantization == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}  # Q4_1, Q8_0 embedding
    model, wrapper, _ = load_directory(directory)
    prompt = encode_chat(embedded.tokenizer, MESSAGES).tokens
    assert list(wrapper.apply_chat_template(MESSAGES, add_generation_prompt=True)) == list(prompt)
    ours = Generation(embedded, prompt, GenerationParams(max_tokens=64)).run()
    assert ours.finish_reason == "stop"  # the EOS ends it well before 64 tokens
    assert mlx_lm_stream_tokens(model, wrapper, list(prompt), 64) == list(ours.token_ids)
