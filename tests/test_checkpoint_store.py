"""The SSD binding of the engine's `CheckpointStore` Protocol: save, load the newest, remove; a
draft model's caches kept beside the target's and resumed from."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxkv.engine.cache_services import open_cold_tier
from mlxkv.engine.checkpoints import CheckpointStore, RestoredCheckpoint
from mlxkv.engine.jobs import Job as _Job
from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference.generation.results import CheckpointState
from mlxkv_serve import Delta, Finished, GenerateRequest, Sampling, Speculation
from mlxkv_ssd_cache.layout import identity_key
from mlxkv_state.header import GenerationCheckpoint
from tests.factories import count_fed_tokens, make_prompt, make_tiny_binding

KEY = "ab" * 32


def test_ssd_cold_tier_keeps_the_newest_checkpoint_of_a_key_until_removed(tmp_path: Path) -> None:
    binding = make_tiny_binding("llama")
    store: CheckpointStore = open_cold_tier(binding, tmp_path, 1 << 30)
    prompt = make_prompt(12)
    for generated in ((7,), (7, 8)):
        caches = binding.make_cache()
        binding.prefill(prompt + list(generated), caches)
        checkpoint = GenerationCheckpoint("", generated, KEY, len(prompt), 9, 5, True)
        assert store.save_checkpoint(prompt + list(generated), caches, checkpoint, None)
    restored = store.load_checkpoint(KEY)
    assert isinstance(restored, RestoredCheckpoint)
    assert restored.tokens == (*prompt, 7, 8) and restored.checkpoint.generated_tokens == (7, 8)
    assert restored.checkpoint.pending_token == 9 and restored.checkpoint.seed == 5
    assert store.load_checkpoint("cd" * 32) is None
    store.remove_checkpoint(KEY)
    assert store.load_checkpoint(KEY) is None
    assert store.stats().entries == 0  # checkpoints are not prompt-cache entries


def test_a_draft_models_checkpoint_is_kept_beside_the_targets_under_its_own_identity(tmp_path: Path) -> None:
    from mlxkv_inference.cache.reuse import frozen_copy
    from mlxkv_inference.speculative.proposers import DraftState
    from mlxkv_inference.models.draft import layer_skip_draft

    binding = make_tiny_binding("llama", num_hidden_layers=3)
    draft = make_tiny_binding("llama", seed=5, num_hidden_layers=1)
    store = open_cold_tier(binding, tmp_path, 4 << 20, draft=draft)
    assert store.draft_ssd is not None
    assert (store.ssd.max_bytes, store.draft_ssd.max_bytes) == (3 << 20, 1 << 20)  # the cap split by a token's KV
    same = make_tiny_binding("llama", num_hidden_layers=3)  # the target itself as --draft-model: no second store on its files
    assert open_cold_tier(binding, tmp_path, 4 << 20, draft=same).draft_ssd is None
    assert open_cold_tier(binding, tmp_path, 4 << 20, draft=layer_skip_draft(binding, 1)).draft_ssd is None  # copies the target's KV
    prompt = make_prompt(12)
    caches, draft_caches = binding.make_cache(), draft.make_cache()
    binding.prefill(prompt + [7, 8], caches)
    draft.prefill(prompt + [7], draft_caches)
    checkpoint = GenerationCheckpoint("", (7, 8), KEY, len(prompt), 9, 5, True)
    assert store.save_checkpoint(prompt + [7, 8], caches, checkpoint, DraftState((*prompt, 7), draft_caches))

    restored = open_cold_tier(binding, tmp_path, 4 << 20, draft=draft).load_checkpoint(KEY)  # after a restart
    assert restored is not None and restored.draft is not None and restored.draft.tokens == (*prompt, 7)
    for have, want in zip(restored.draft.caches, frozen_copy(draft_caches, 13)):
        assert have.offset == want.offset == 13
        for a, b in zip(have.state, want.state):
            assert mx.array_equal(a, b).item() if isinstance(a, mx.array) and isinstance(b, mx.array) else a == b
    other = open_cold_tier(binding, tmp_path, 4 << 20, draft=make_tiny_binding("llama", seed=6, num_hidden_layers=1)).load_checkpoint(KEY)
    assert other is not None and other.draft is None  # another draft model's identity: the target's part only
    assert open_cold_tier(binding, tmp_path, 4 << 20).load_checkpoint(KEY) is not None  # no draft model at all

    # a draft file that does not read back is a miss for the draft only
    (file,) = (tmp_path / identity_key(store.draft_ssd.identity) / "checkpoints").glob("*.mlxkv")
    file.write_bytes(file.read_bytes()[:-64])
    restored = open_cold_tier(binding, tmp_path, 4 << 20, draft=draft).load_checkpoint(KEY)
    assert restored is not None and restored.draft is None and restored.tokens == (*prompt, 7, 8)

    short = frozen_copy(draft_caches, 12)
    two_layers = make_tiny_binding("llama", seed=5, num_hidden_layers=2).make_cache()
    # not a prefix of the target's tokens; caches holding fewer tokens than said; another model's layers
    for tokens, wrong in (((*prompt, 3), draft_caches), ((*prompt, 7), short), ((*prompt, 7), two_layers)):
        assert store.save_checkpoint(prompt + [7, 8], caches, checkpoint, DraftState(tokens, wrong))
        restored = store.load_checkpoint(KEY)
        assert restored is not None and restored.draft is None and restored.tokens == (*prompt, 7, 8)
    store.remove_checkpoint(KEY)
    assert store.draft_ssd.stats().bytes == 0 and store.load_checkpoint(KEY) is None


class CrashAfterCheckpoint(LocalEngine):
    """A real engine whose generation stops right after its first checkpoint is queued, as a
    server killed at that moment would."""

    def _save_checkpoint(self, job: _Job, state: CheckpointState) -> None:
        super()._save_checkpoint(job, state)
        job.handle.cancel()


def test_the_engine_resumes_a_drafting_generation_with_its_draft_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binding = make_tiny_binding("llama")
    draft = make_tiny_binding("llama")  # the target's weights as a model of its own (a layer-skip draft copies the target's KV)
    draft.model_id = "tiny-llama-draft"  # its own identity, so its own store
    fed = count_fed_tokens(draft, monkeypatch)
    prompt = (make_prompt(9, seed=3) * 7)[:60]  # repeats itself: the draft's guesses get accepted
    request = GenerateRequest(max_tokens=24, sampling=Sampling(temperature=0), prompt_tokens=tuple(prompt),
                              speculative=Speculation("draft", 3))

    def run(engine_class: type[LocalEngine]) -> tuple[str, Finished, Mapping[str, Any]]:
        cold = open_cold_tier(binding, tmp_path, 1 << 30, draft=draft)
        assert cold.draft_ssd is not None
        engine = engine_class(binding, None, ssd=cold, checkpoint_every=8, draft=draft)
        try:
            text, finished = asyncio.run(collect(engine, request))
            return text, finished, engine.generation_state(finished.generation_id) or {}
        finally:
            engine.close(30)

    expected, finished, _ = run(LocalEngine)
    assert finished.finish_reason == "length"
    _, crashed, _ = run(CrashAfterCheckpoint)
    assert crashed.finish_reason == "cancelled"
    fed.clear()
    resumed, finished, state = run(LocalEngine)
    assert resumed == expected and finished.finish_reason == "length" and state["resumed_tokens"] == 8
    assert fed and max(fed) < len(prompt)  # the draft went on from its checkpointed caches (re-reading: 67 tokens)


async def collect(engine: LocalEngine, request: GenerateRequest) -> tuple[str, Finished]:
    text = ""
    async for event in (await engine.submit(request)).events():
        if isinstance(event, Delta):
            text += event.text
        elif isinstance(event, Finished):
            return text, event
        else:
            raise AssertionError(f"the generation failed: {event}")
    raise AssertionError("the generation never finished")
