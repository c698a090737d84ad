"""Logprobs survive a checkpoint: a resumed request answers the logprobs (values and
alternatives) of the uninterrupted run, and the checkpoint header validates what it stores."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from mlxkv.engine.cache_services import SsdColdTier, open_cold_tier
from mlxkv.engine.jobs import Job as _Job
from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference.generation.results import CheckpointState
from mlxkv_serve import Delta, Finished, GenerateRequest, Sampling, TokenLogprob
from mlxkv_ssd_cache import SsdCacheStore
from mlxkv_state.errors import StateError
from mlxkv_state.header import GenerationCheckpoint, KvFileHeader, TokenLogprobs, header_from_json
from tests.factories import make_prompt, make_tiny_binding

EVERY = 4


class CrashAfterCheckpoint(LocalEngine):
    """A real engine whose generation stops right after its first checkpoint is queued, as a
    server killed at that moment would (the checkpoint stays behind: nothing finished it)."""

    def _save_checkpoint(self, job: _Job, state: CheckpointState) -> None:
        super()._save_checkpoint(job, state)
        job.handle.cancel()


async def collect(engine: LocalEngine, request: GenerateRequest) -> tuple[list[TokenLogprob], str, Finished]:
    handle = await engine.submit(request)
    logprobs: list[TokenLogprob] = []
    text = ""
    async for event in handle.events():
        if isinstance(event, Delta):
            logprobs.extend(event.logprobs)
            text += event.text
        elif isinstance(event, Finished):
            return logprobs, text, event
        else:
            raise AssertionError(f"the generation failed: {event}")
    raise AssertionError("the generation never finished")


def run(engine_class: type[LocalEngine], binding: MlxAutoregressiveBinding, store: SsdCacheStore,
        request: GenerateRequest) -> tuple[list[TokenLogprob], str, Finished, dict[str, Any]]:
    engine = engine_class(binding, None, ssd=SsdColdTier(store), checkpoint_every=EVERY)
    try:
        logprobs, text, finished = asyncio.run(collect(engine, request))
        assert engine.flush(30).durable
        state = dict(engine.generation_state(finished.generation_id) or {})
    finally:
        engine.close(30)
    return logprobs, text, finished, state


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=0.9, seed=11)], ids=["greedy", "seeded"])
def test_resumed_request_answers_the_uninterrupted_runs_logprobs(sampling: Sampling, tmp_path: Path) -> None:
    binding = make_tiny_binding("llama")
    store = open_cold_tier(binding, tmp_path, 1 << 30).ssd
    request = GenerateRequest(max_tokens=20, sampling=sampling, prompt_tokens=tuple(make_prompt(12)), top_logprobs=3)
    expected, expected_text, finished, _ = run(LocalEngine, binding, store, request)
    assert (finished.finish_reason, len(expected)) == ("length", 20)
    assert all(len(lp.top) == 3 for lp in expected)

    first, _, crashed, _ = run(CrashAfterCheckpoint, binding, store, request)  # checkpoint after 4 tokens
    assert crashed.finish_reason == "cancelled" and first == expected[: len(first)]
    second, _, crashed, state = run(CrashAfterCheckpoint, binding, store, request)  # resumes at 4, checkpoints at 8
    assert crashed.finish_reason == "cancelled" and state["resumed_tokens"] == EVERY
    assert second == expected[: len(second)]
    resumed, resumed_text, finished, state = run(LocalEngine, binding, store, request)
    assert state["resumed_tokens"] == 2 * EVERY  # the second checkpoint carried the replayed logprobs on
    assert resumed_text == expected_text and finished.finish_reason == "length"
    assert resumed == expected


def test_a_request_asking_other_logprobs_does_not_take_the_checkpoint(tmp_path: Path) -> None:
    binding = make_tiny_binding("llama")
    store = open_cold_tier(binding, tmp_path, 1 << 30).ssd
    request = GenerateRequest(max_tokens=12, sampling=Sampling(temperature=0), prompt_tokens=tuple(make_prompt(10)), top_logprobs=2)
    run(CrashAfterCheckpoint, binding, store, request)
    more = GenerateRequest(max_tokens=12, sampling=Sampling(temperature=0), prompt_tokens=request.prompt_tokens, top_logprobs=4)
    logprobs, _, _, state = run(LocalEngine, binding, store, more)
    assert "resumed_tokens" not in state and [len(lp.top) for lp in logprobs] == [4] * 12


def header_with(checkpoint: GenerationCheckpoint) -> dict[str, Any]:
    header = KvFileHeader(caches=(), tokens=(1, 2, 3), model_id="m", ns="", tokenizer_hash="t", config_fingerprint="f",
                          codec_provider="c", created_at=0.0, generation_checkpoint=checkpoint)
    loaded: dict[str, Any] = json.loads(json.dumps(header.to_json()))
    return loaded


CHECKPOINT = GenerationCheckpoint(
    cache_ns="", generated_tokens=(7, 8), key="ab" * 32, original_prompt_tokens=1, pending_token=9, seed=5,
    seed_was_explicit=False,
    logprobs=(TokenLogprobs(-0.25, ((7, -0.25), (3, -1.5))), TokenLogprobs(-1.0, ((2, -0.5), (8, -1.0))),
              TokenLogprobs(float("-inf"), ((1, -0.125), (4, -2.0)))),
)


def test_checkpoint_logprobs_round_trip_through_the_header() -> None:
    assert header_from_json(header_with(CHECKPOINT)).generation_checkpoint == CHECKPOINT
    without = header_with(CHECKPOINT)
    del without["generation_checkpoint"]["logprobs"]  # written before logprobs were kept
    parsed = header_from_json(without).generation_checkpoint
    assert parsed is not None and parsed.logprobs is None


@pytest.mark.parametrize(
    "bad",
    [
        "not a list",
        [{"logprob": -1.0, "top": []}] * 2,  # one entry short of generated + pending
        [{"logprob": "-1", "top": []}] * 3,
        [{"logprob": True, "top": []}] * 3,
        [{"top": []}] * 3,
        [{"logprob": -1.0, "top": [[1]]}] * 3,
        [{"logprob": -1.0, "top": [["1", -1.0]]}] * 3,
        [{"logprob": -1.0, "top": [[1, None]]}] * 3,
        [{"logprob": -1.0, "top": {"1": -1.0}}] * 3,
        [[-1.0, []]] * 3,
    ],
)
def test_bad_checkpoint_logprobs_are_a_state_error(bad: Any) -> None:
    header = header_with(CHECKPOINT)
    header["generation_checkpoint"]["logprobs"] = bad
    with pytest.raises(StateError):
        header_from_json(header)
