"""Seeded sampling: keys depend on (seed, step) alone, so restarts continue exactly."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv_inference import Generation, GenerationParams, SamplingParams, step_key
from mlxkv_inference.generation.results import ResumePoint
from tests.factories import make_prompt, make_tiny_binding

SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)


def test_step_key_depends_on_seed_and_step_only() -> None:
    assert mx.array_equal(step_key(7, 3), step_key(7, 3))
    keys = {tuple(step_key(seed, step).tolist()) for seed in (0, 1, 2) for step in (0, 1, 2)}  # type: ignore[arg-type]
    assert len(keys) == 9


def test_same_seed_gives_same_tokens() -> None:
    binding = make_tiny_binding("llama")
    prompt = make_prompt(12)
    params = GenerationParams(max_tokens=30, sampling=SAMPLED)
    first = Generation(binding, prompt, params).run()
    second = Generation(binding, prompt, params).run()
    other = Generation(binding, prompt, GenerationParams(max_tokens=30, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=99))).run()
    assert first.token_ids == second.token_ids
    assert first.token_ids != other.token_ids
    assert first.seed == 1234


@pytest.mark.parametrize("restart_at", [1, 7, 20])
@pytest.mark.parametrize(
    "sampling",
    [SAMPLED, SamplingParams(temperature=1.0, top_k=20, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5, seed=5)],
)
def test_restart_at_step_k_continues_identically(restart_at: int, sampling: SamplingParams) -> None:
    binding = make_tiny_binding("llama")
    prompt = make_prompt(12)
    full = Generation(binding, prompt, GenerationParams(max_tokens=30, sampling=sampling)).run().token_ids
    assert len(full) == 30
    caches = binding.make_cache()
    binding.prefill(prompt + list(full[:restart_at]), caches)  # the state a checkpoint after restart_at tokens holds
    resumed = Generation(
        binding, prompt, GenerationParams(max_tokens=30, sampling=sampling), caches,
        resume=ResumePoint(full[:restart_at], full[restart_at]),
    ).run()
    assert resumed.token_ids == full


def test_unseeded_generation_reports_the_seed_it_chose_and_replays_with_it() -> None:
    binding = make_tiny_binding("llama")
    prompt = make_prompt(12)
    first = Generation(binding, prompt, GenerationParams(max_tokens=20, sampling=SamplingParams(temperature=0.9))).run()
    replay = Generation(binding, prompt, GenerationParams(max_tokens=20, sampling=SamplingParams(temperature=0.9, seed=first.seed))).run()
    assert replay.token_ids == first.token_ids


def test_logit_bias_forces_a_token() -> None:
    binding = make_tiny_binding("llama")
    params = GenerationParams(max_tokens=5, sampling=SamplingParams(logit_bias={65: 100.0}))
    assert Generation(binding, make_prompt(8), params).run().token_ids == (65,) * 5


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [("temperature", -0.1, ">= 0"), ("top_p", 0.0, "(0, 1]"), ("top_k", -1, ">= 0"), ("min_p", 1.5, "[0, 1]"),
     ("repetition_penalty", 0.0, "> 0"), ("presence_penalty", 3.0, "[-2, 2]"), ("seed", -1, "[0, ")],
)
def test_out_of_range_sampling_values_name_the_allowed_range(field: str, value: float, allowed: str) -> None:
    with pytest.raises(ValueError, match=f"{field}={value!r} is out of range; allowed: {allowed}".replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
