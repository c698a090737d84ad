"""Gemma 3 270M (real weights, sliding window 512) through the paths the embedded model's tests
pin: batching, speculation and resume after kill -9 of a real server. Short prompts and
generations on the session's one loaded model; skipped where the `gemma3` group is missing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, SamplingParams
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.models.draft import layer_skip_draft
from mlxkv_inference.prompt_cache import TieredPromptCache
from mlxkv_inference.scheduler.batch import BatchScheduler
from mlxkv_inference.speculative.speculation import SpeculativeParams
from tests.server_process import ServerProcess
from tests.test_batching import alone, scheduled
from tests.test_resume_after_kill import complete, generation_state, stream_chunks

# Lines a base model copies when it meets their start again: what prompt lookup drafts from.
READY_S = 600  # loading Gemma (its K-quant blocks converted) takes minutes on a busy 2-core machine
TABLE = "".join(f"rate_{i} = lookup(rate_{i}, default={i * 3})\n" for i in range(6))


def test_gemma3_rows_stepped_together_get_their_tokens_alone(gemma3_native: MlxAutoregressiveBinding) -> None:
    binding = gemma3_native
    texts = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]
    specs = [(binding.tokenizer.encode(text),
              GenerationParams(max_tokens=6 + i, ignore_eos=True,
                               sampling=SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams()))
             for i, text in enumerate(texts)]
    expected = alone(binding, specs)
    scheduler = BatchScheduler(binding, max_batch=3, prefill_budget=64)
    assert scheduled(scheduler, binding, specs) == expected
    assert [len(tokens) for tokens in expected] == [6, 7, 8]
    assert scheduler.batched_steps > 0  # rows stacked in one step, not a graph per row


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.7, seed=5)], ids=["greedy", "seeded"])
def test_gemma3_prompt_lookup_gives_exactly_the_plain_tokens(gemma3_native: MlxAutoregressiveBinding,
                                                             sampling: SamplingParams) -> None:
    binding = gemma3_native
    prompt = binding.tokenizer.encode(TABLE + "\n# again:\n" + TABLE[:16])  # ends at "lookup(", a token boundary
    plain = Generation(binding, prompt, GenerationParams(max_tokens=24, ignore_eos=True, sampling=sampling)).run()
    spec = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=6, adaptive=False)
    fast = Generation(binding, prompt, GenerationParams(max_tokens=24, ignore_eos=True, sampling=sampling,
                                                        speculative=spec)).run()
    assert fast.token_ids == plain.token_ids
    assert fast.accepted_tokens > 0  # it copied, so drafts were taken, not only proposed
    if sampling.temperature == 0:
        assert binding.tokenizer.decode(list(plain.token_ids)).startswith(TABLE[16:60])


def test_gemma3_prompt_lookup_past_the_sliding_window_gives_exactly_the_plain_tokens(
        gemma3_native: MlxAutoregressiveBinding) -> None:
    binding = gemma3_native
    table = "".join(f"rate_{i} = lookup(rate_{i}, default={i * 3})\n" for i in range(30))
    prompt = binding.tokenizer.encode(table + "\n# again:\n" + table[:16])
    assert 512 < len(prompt) < 600  # the rings wrapped before the first round
    params = GenerationParams(max_tokens=24, ignore_eos=True)
    plain = Generation(binding, prompt, params).run()
    spec = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=6, adaptive=False)
    fast = Generation(binding, prompt, replace(params, speculative=spec)).run()
    assert fast.token_ids == plain.token_ids
    assert fast.accepted_tokens > 0


def test_gemma3_layer_skip_draft_needs_the_first_global_layer(gemma3_native: MlxAutoregressiveBinding) -> None:
    with pytest.raises(ValueError, match=r"draft layers=4: .* layer 6; allowed: \[6, 17\]"):
        layer_skip_draft(gemma3_native, 4)
    draft = layer_skip_draft(gemma3_native, 6)
    prompt = gemma3_native.tokenizer.encode(TABLE)
    spec = SpeculativeParams(mode="draft", num_draft_tokens=4, adaptive=False)
    params = GenerationParams(max_tokens=8, ignore_eos=True)
    fast = Generation(gemma3_native, prompt, replace(params, speculative=spec), draft=draft).run()
    assert fast.token_ids == Generation(gemma3_native, prompt, params).run().token_ids
    assert fast.draft_tokens > 0


def test_gemma3_server_killed_mid_generation_resumes_with_the_uninterrupted_text(
    gemma3_path: Path, gemma3_native: MlxAutoregressiveBinding, tmp_path: Path
) -> None:
    no_eos = {str(token): -100.0 for token in gemma3_native.eos_token_ids}
    prompt = "def fibonacci(n):"
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "logit_bias": no_eos}
    cache, serve = tmp_path / "cache", ("--model", str(gemma3_path), "--cpu-kernels", "native", "--generation-checkpoint", "8")
    first = ServerProcess(cache, *serve, ready_timeout=READY_S)
    try:
        seen = 0
        for chunk in stream_chunks(first.url, body):
            seen += bool(chunk["choices"] and chunk["choices"][0]["text"])
            if seen == 20:  # the checkpoints at 8 and 16 tokens are queued: make them durable, then kill
                assert httpx.post(first.url + "/admin/cache/flush", timeout=120).status_code == 200
                first.process.kill()
                break
        first.process.wait(30)
    finally:
        first.stop()
    second = ServerProcess(cache, *serve, ready_timeout=READY_S)
    try:
        resumed = complete(second, body)
        resumed_tokens = generation_state(second, resumed["id"])["resumed_tokens"]
    finally:
        second.stop()
    assert resumed_tokens >= 16 and resumed_tokens % 8 == 0
    assert resumed["usage"]["resumed_tokens"] == resumed_tokens
    assert resumed["usage"]["completion_tokens"] == 48
    logit_bias = {int(token): bias for token, bias in no_eos.items()}
    generator = CachedGenerator(gemma3_native, TieredPromptCache(1 << 30))
    params = GenerationParams(max_tokens=48, sampling=SamplingParams(logit_bias=logit_bias))
    expected = generator.start(gemma3_native.tokenizer.encode(prompt), params).run().text
    assert resumed["choices"][0]["text"] == expected
    assert expected.startswith("\n    if n == 0:")

