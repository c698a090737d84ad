"""Acceptance for the tiered cache: multi-turn chats hit on every kind of model, a restarted
process restores from the SSD, and memory stays under the RAM cap."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv.engine.cache_services import build_tiers
from mlxkv_inference import GenerationParams, MlxAutoregressiveBinding
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.prompt_cache import TieredPromptCache
from mlxkv_inference.tokenizer.chat import encode_chat
from tests.factories import make_prompt, make_tiny_binding

QUESTIONS = ["Name a planet.", "Why is it red?", "How far is it?", "Could people live there?", "Thanks! One more fact?"]


def chat(binding: MlxAutoregressiveBinding, tiers: TieredPromptCache, turns: int, max_tokens: int) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each turn of a chat that re-sends its whole history."""
    generator = CachedGenerator(binding, tiers)
    messages: list[dict[str, str]] = []
    out = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        prompt = encode_chat(binding.tokenizer, messages)
        generation = generator.start(prompt.tokens, GenerationParams(max_tokens=max_tokens), history_end=prompt.history_end)
        result = generation.run()
        generator.settle(generation)
        messages.append({"role": "assistant", "content": result.text})
        out.append((len(prompt.tokens), result.cached_tokens))
    return out


def assert_each_turn_reuses_the_previous_prompt(turns: list[tuple[int, int]]) -> None:
    assert turns[0][1] == 0
    for (previous_prompt, _), (_, cached) in zip(turns, turns[1:]):
        assert cached >= previous_prompt - 1


def test_embedded_five_turn_chat_reuses_each_previous_prompt(embedded: MlxAutoregressiveBinding, tmp_path: Path) -> None:
    tiers, _ = build_tiers(embedded, ram_bytes=1 << 30, ssd_dir=tmp_path, ssd_bytes=1 << 30)
    assert_each_turn_reuses_the_previous_prompt(chat(embedded, tiers, 5, max_tokens=8))
    assert tiers.close(30).durable


@pytest.mark.parametrize("kind", ["gemma3_text", "qwen3_next"])
def test_untrimmable_models_hit_on_every_turn(kind: str, tmp_path: Path) -> None:
    binding = make_tiny_binding(kind)  # window 8 (wrapped every turn) / recurrent layers
    tiers, _ = build_tiers(binding, ram_bytes=1 << 30, ssd_dir=tmp_path, ssd_bytes=1 << 30)
    turns = chat(binding, tiers, 5, max_tokens=12)
    assert_each_turn_reuses_the_previous_prompt(turns)
    assert turns[-1][0] > 8 * 5
    assert tiers.close(30).durable


def run_cli(*args: str) -> tuple[str, int]:
    done = subprocess.run([str(Path(sys.executable).parent / "mlxkv"), "generate", *args],
                          capture_output=True, text=True, timeout=300, check=True)
    cached = re.search(r"\((\d+) cached\)", done.stderr)
    assert cached is not None, done.stderr
    return done.stdout, int(cached.group(1))


def test_embedded_restart_restores_from_ssd_and_matches_no_cache(tmp_path: Path) -> None:
    question = ["What are the three primary colors?", "--max-tokens", "16", "--temp", "0"]
    first, cached_first = run_cli(*question, "--ssd-cache", str(tmp_path))
    second, cached_second = run_cli(*question, "--ssd-cache", str(tmp_path))  # a new process
    uncached, _ = run_cli(*question, "--no-ssd-cache")
    assert (cached_first, cached_second) == (0, 36)
    assert first == second == uncached


def test_ram_tier_stays_under_its_cap_for_fifty_long_prompts() -> None:
    # 4 layers x 4 KV heads x 64 dims in float32: 8 KiB a token, ~8 MiB a 1000-token prompt.
    binding = make_tiny_binding("llama", num_hidden_layers=4, num_key_value_heads=4, num_attention_heads=4, head_dim=64)
    cap = 64 << 20
    tiers = TieredPromptCache(ram_max_bytes=cap)
    generator = CachedGenerator(binding, tiers)
    mx.eval(mx.zeros(1))
    baseline = mx.get_active_memory()
    peak = 0
    for i in range(50):
        generation = generator.start(make_prompt(1000, seed=i), GenerationParams(max_tokens=2, ignore_eos=True))
        generation.run()
        generator.settle(generation)
        del generation
        assert tiers.stats().ram_bytes <= cap
        peak = max(peak, mx.get_active_memory() - baseline)
    stats = tiers.stats()
    assert stats.ram_evictions >= 40 and stats.ram_entries <= 8
    # What MLX holds beyond the cached entries is bounded by about one live generation.
    assert peak < cap + (32 << 20)
