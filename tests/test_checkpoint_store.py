"""The SSD binding of the engine's `CheckpointStore` Protocol: save, load the newest, remove."""

from __future__ import annotations

from pathlib import Path

from mlxkv.engine.cache_services import open_cold_tier
from mlxkv.engine.checkpoints import CheckpointStore, RestoredCheckpoint
from mlxkv_state.header import GenerationCheckpoint
from tests.factories import make_prompt, make_tiny_binding

KEY = "ab" * 32


def test_ssd_cold_tier_keeps_the_newest_checkpoint_of_a_key_until_removed(tmp_path: Path) -> None:
    binding = make_tiny_binding("llama")
    store: CheckpointStore = open_cold_tier(binding, tmp_path, 1 << 30)
    prompt = make_prompt(12)
    for generated in ((7,), (7, 8)):
        caches = binding.make_cache()
        binding.prefill(prompt + list(generated), caches)
        checkpoint = GenerationCheckpoint("", generated, KEY, len(prompt), 9, 5, True)
        assert store.save_checkpoint(prompt + list(generated), caches, checkpoint)
    restored = store.load_checkpoint(KEY)
    assert isinstance(restored, RestoredCheckpoint)
    assert restored.tokens == (*prompt, 7, 8) and restored.checkpoint.generated_tokens == (7, 8)
    assert restored.checkpoint.pending_token == 9 and restored.checkpoint.seed == 5
    assert store.load_checkpoint("cd" * 32) is None
    store.remove_checkpoint(KEY)
    assert store.load_checkpoint(KEY) is None
    assert store.stats().entries == 0  # checkpoints are not prompt-cache entries
