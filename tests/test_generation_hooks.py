"""A generation's callbacks travel as one `GenerationHooks`, or as its fields passed as keywords."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mlxkv_inference import Generation, GenerationParams
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.generation.hooks import GenerationHooks
from mlxkv_inference.generation.results import CheckpointState
from tests.factories import make_prompt, make_tiny_binding


def test_hooks_and_their_keyword_fields_call_back_alike() -> None:
    binding = make_tiny_binding("llama")
    prompt = make_prompt(12)
    params = GenerationParams(max_tokens=10, ignore_eos=True)
    calls: dict[str, list[tuple[object, ...]]] = {"hooks": [], "keywords": []}

    def recorder(into: list[tuple[object, ...]]) -> GenerationHooks:
        def snapshot(tokens: Sequence[int], caches: list[LayerCache]) -> None:
            into.append(("snapshot", len(tokens)))

        def checkpoint(state: CheckpointState) -> None:
            into.append(("checkpoint", len(state.generated)))

        return GenerationHooks(snapshot_at=(4, 11), on_snapshot=snapshot, checkpoint_every=4, on_checkpoint=checkpoint,
                               on_prefill_progress=lambda fed, total: into.append(("progress", fed, total)))

    by_hooks = Generation(binding, prompt, params, hooks=recorder(calls["hooks"])).run()
    fields = recorder(calls["keywords"])
    by_keywords = Generation(binding, prompt, params, snapshot_at=fields.snapshot_at, on_snapshot=fields.on_snapshot,
                             checkpoint_every=fields.checkpoint_every, on_checkpoint=fields.on_checkpoint,
                             on_prefill_progress=fields.on_prefill_progress).run()
    assert by_hooks.token_ids == by_keywords.token_ids
    assert calls["hooks"] == calls["keywords"]
    assert [c for c in calls["hooks"] if c[0] != "progress"] == [
        ("snapshot", 4), ("snapshot", 11), ("checkpoint", 4), ("checkpoint", 8)]


def test_hooks_and_their_fields_together_are_refused() -> None:
    binding = make_tiny_binding("llama")
    with pytest.raises(ValueError, match=r"pass hooks or its fields \(checkpoint_every\), not both"):
        Generation(binding, make_prompt(4), GenerationParams(), hooks=GenerationHooks(), checkpoint_every=2)
