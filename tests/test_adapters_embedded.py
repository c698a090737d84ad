"""A LoRA adapter trained here on the embedded model with mlx-lm's trainer: greedy answers under
it equal mlx-lm's with the same adapter (`load_adapters`, what `load(..., adapter_path=...)` runs),
token for token, on MLX's kernels. Slower than most (111 s measured on the shared 2-core machine
at load average 14; not measured idle): the embedded model on MLX's single-threaded kernels, two
training steps on 4 of its 30 layers. It is the acceptance test that real adapters of the embedded
model agree with mlx-lm."""

from __future__ import annotations

from pathlib import Path

from mlxkv_inference import EMBEDDED_MODEL_ID, Generation, GenerationParams, MlxAutoregressiveBinding, embedded_model_path
from mlxkv_inference._mlx_lm import apply_adapter, mlx_lm_step_tokens, train_adapter
from mlxkv_inference.models.gguf import load_gguf
from tests.adapter_factories import adapted_caches


def test_an_adapter_trained_on_the_embedded_model_answers_as_mlx_lm_with_it(
        embedded: MlxAutoregressiveBinding, tmp_path: Path) -> None:
    tokens = embedded.tokenizer.encode("The capital of France is Lyon. The capital of France is Lyon.")
    train_adapter(load_gguf(embedded_model_path()).model, [tokens] * 2, tmp_path / "lyon", num_layers=4, rank=4,
                  iters=2, learning_rate=5e-2, base_model=EMBEDDED_MODEL_ID)
    prompt = embedded.tokenizer.encode("The capital of France is")
    params = GenerationParams(max_tokens=8, ignore_eos=True)
    ours = Generation(embedded, prompt, params, caches=adapted_caches(embedded, tmp_path / "lyon")).run().token_ids
    theirs = mlx_lm_step_tokens(apply_adapter(load_gguf(embedded_model_path()).model, tmp_path / "lyon"), prompt, 8)
    assert list(ours) == theirs
    assert ours != Generation(embedded, prompt, params).run().token_ids
