"""Resuming from a checkpoint continues with exactly the tokens of the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, SamplingParams
from mlxkv_inference.cache.reuse import clone_trimmed
from mlxkv_inference.generation.results import CheckpointState, ResumePoint
from mlxkv_ssd_cache import SsdCacheStore
from mlxkv_state.header import GenerationCheckpoint
from tests.factories import make_identity, make_prompt, make_tiny_binding

SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.2, seed=77)


def run_with_checkpoints(binding: MlxAutoregressiveBinding, prompt: list[int], params: GenerationParams, every: int) -> tuple[tuple[int, ...], list[CheckpointState]]:
    states: list[CheckpointState] = []
    generation = Generation(binding, prompt, params, checkpoint_every=every, on_checkpoint=states.append)
    return generation.run().token_ids, states


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "qwen3_next"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_resume_from_each_checkpoint_matches_the_uninterrupted_run(kind: str, sampling: SamplingParams) -> None:
    binding = make_tiny_binding(kind)
    prompt = make_prompt(12)
    params = GenerationParams(max_tokens=40, sampling=sampling, ignore_eos=True)
    full, states = run_with_checkpoints(binding, prompt, params, every=8)
    full_text = Generation(binding, prompt, params).run().text
    assert [len(s.generated) for s in states] == [8, 16, 24, 32]
    for state in states:
        resumed = Generation(binding, prompt, params, caches=clone_trimmed(state.caches, len(prompt) + len(state.generated)),
                             resume=ResumePoint(state.generated, state.pending))
        texts = [d.text for d in resumed]
        assert resumed.result is not None and resumed.result.token_ids == full
        assert resumed.result.cached_tokens == len(prompt) + len(state.generated)
        assert "".join(texts) == full_text


def test_checkpoint_round_trips_through_the_store(tmp_path: Path) -> None:
    binding = make_tiny_binding("gemma3_text")
    prompt = make_prompt(12)
    params = GenerationParams(max_tokens=30, sampling=SAMPLED, ignore_eos=True)
    full, states = run_with_checkpoints(binding, prompt, params, every=10)
    state = states[-1]
    store = SsdCacheStore(tmp_path, make_identity(binding), 1 << 30)
    checkpoint = GenerationCheckpoint("", state.generated, "ab" * 32, len(prompt), state.pending, state.seed, True)
    assert store.save_checkpoint(prompt + list(state.generated), state.caches, checkpoint)
    restored = SsdCacheStore(tmp_path, make_identity(binding), 1 << 30).load_checkpoint("ab" * 32)
    assert restored is not None and restored.generation_checkpoint == checkpoint
    resumed = Generation(binding, prompt, params, caches=restored.caches, resume=ResumePoint(state.generated, state.pending)).run()
    assert resumed.token_ids == full
    store.remove_checkpoint("ab" * 32)
    assert store.load_checkpoint("ab" * 32) is None


def test_corrupt_checkpoint_is_ignored(tmp_path: Path) -> None:
    binding = make_tiny_binding("llama")
    prompt = make_prompt(12)
    _, states = run_with_checkpoints(binding, prompt, GenerationParams(max_tokens=20, ignore_eos=True), every=8)
    store = SsdCacheStore(tmp_path, make_identity(binding), 1 << 30)
    state = states[0]
    checkpoint = GenerationCheckpoint("", state.generated, "cd" * 32, len(prompt), state.pending, state.seed, False)
    assert store.save_checkpoint(prompt + list(state.generated), state.caches, checkpoint)
    path = next(tmp_path.rglob("checkpoints/*.mlxkv"))
    path.write_bytes(path.read_bytes()[:-100])
    assert store.load_checkpoint("cd" * 32) is None
    assert not path.exists()  # quarantined
