"""The native sampler (mlxkv-cpu-kernels `sample`) against an oracle built on mlx-lm's own filters
(apply_top_k, apply_min_p, apply_top_p) and a float64 inverse CDF, and its place in generation.

Seeded generations through it (alone, batched, speculating, resumed) are pinned by the native tiny
models of test_batching.py, test_speculative.py and the tests below.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import mlxkv_inference  # noqa: F401  (loads the BLAS shim before mlx, as the app does)

if sys.platform != "linux":
    pytest.skip("mlxkv-cpu-kernels is a Linux-only package", allow_module_level=True)

import mlx.core as mx
from mlxkv_cpu_kernels import ops

from mlxkv_inference import Generation, GenerationParams, SamplingParams, _mlx_lm
from mlxkv_inference.native.install import NATIVE_SAMPLER
from mlxkv_inference.generation.results import ResumePoint
from mlxkv_inference.generation.sampling import make_sampler, step_word
from tests.factories import make_prompt, make_tiny_binding

Filters = tuple[int, float, float]  # top_k (0: off), min_p (0: off), top_p (1: off)
FILTERS: list[Filters] = [(0, 0.0, 1.0), (5, 0.0, 1.0), (40, 0.0, 1.0), (0, 0.05, 1.0), (0, 0.0, 0.9), (0, 0.0, 0.5),
                          (40, 0.05, 0.9)]


def draw(x: mx.array, words: mx.array, inv_temperature: float, filters: Filters = (0, 0.0, 1.0)) -> mx.array:
    top_k, min_p, top_p = filters
    out: mx.array = ops.sample(x, words, inv_temperature=inv_temperature, top_k=top_k, min_p=min_p, top_p=top_p)
    return out


def logprobs_of(rows: int, vocab: int, seed: int, spread: float) -> mx.array:
    logits = mx.random.normal((rows, vocab), key=mx.random.key(seed)) * spread
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def oracle(row: np.ndarray, word: int, temperature: float, filters: Filters) -> tuple[int, float]:
    """(token, distance of u from the nearest CDF step): mlx-lm's filters in the sampler's order,
    then the inverse CDF of softmax(kept / temperature) in float64."""
    top_k, min_p, top_p = filters
    x = mx.array(row[None])
    if top_k:
        x = _mlx_lm.apply_top_k(x, top_k)
    if min_p:
        x = _mlx_lm.apply_min_p(x, min_p)
    if top_p < 1:
        x = _mlx_lm.apply_top_p(x, top_p)
    kept = np.array(x[0]).astype(np.float64)
    weights = np.where(np.isfinite(kept), np.exp((kept - kept.max()) / temperature), 0.0)
    cdf = np.cumsum(weights) / weights.sum()
    u = (word >> 11) * 2.0**-53
    return int(np.searchsorted(cdf, u, side="right")), float(np.min(np.abs(cdf - u)))


@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_draws_the_token_of_mlx_lm_filters_and_the_inverse_cdf(filters: Filters, temperature: float) -> None:
    rng = np.random.default_rng(int(temperature * 10) + filters[0])
    checked = 0
    for trial in range(12):
        logprobs = logprobs_of(16, 1000, seed=trial, spread=float(rng.uniform(0.5, 5)))
        words = [int(w) for w in rng.integers(0, 2**63, size=16, dtype=np.uint64) * 2 + 1]
        got = np.array(draw(logprobs, mx.array(np.array(words, dtype=np.uint64)), 1 / temperature, filters))
        rows = np.array(logprobs)
        for r, word in enumerate(words):
            want, margin = oracle(rows[r], word, temperature, filters)
            if margin > 1e-6:  # u on a CDF step: float32 and float64 sums may round either way
                assert got[r] == want, (trial, r, filters, temperature)
                checked += 1
    assert checked > 150


@pytest.mark.parametrize("top_k", [1, 5, 40, 300])
def test_top_k_over_a_large_vocabulary_keeps_the_k_largest(top_k: int) -> None:
    """Over a vocabulary of many 64-token blocks the k-th largest is selected among the tokens at
    or above the k-th largest block maximum (sampling.cpp): the same tokens as mlx-lm's top-k."""
    logprobs = logprobs_of(8, 20000, seed=5, spread=3.0)
    words = [int(w) for w in np.random.default_rng(top_k).integers(0, 2**63, size=8, dtype=np.uint64) * 2]
    got = np.array(draw(logprobs, mx.array(np.array(words, dtype=np.uint64)), 1.0, (top_k, 0.0, 1.0)))
    rows = np.array(logprobs)
    for r, word in enumerate(words):
        want, margin = oracle(rows[r], word, 1.0, (top_k, 0.0, 1.0))
        assert margin <= 1e-6 or got[r] == want, (r, top_k)
        assert rows[r][got[r]] >= np.sort(rows[r])[-top_k]  # one of the k largest, whatever u


def test_a_row_draws_the_same_token_alone_in_a_batch_or_strided() -> None:
    logprobs = logprobs_of(9, 3000, seed=1, spread=3.0)
    words = mx.array(np.arange(1, 10, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    together = ops.sample(logprobs, words, inv_temperature=1.3, top_p=0.9)
    for row in (0, 4, 8):
        assert ops.sample(logprobs[row : row + 1], words[row : row + 1], inv_temperature=1.3, top_p=0.9).item() \
            == together[row].item()
    strided = mx.concatenate([logprobs, logprobs], axis=1)[:, ::2]  # every other entry: read in place of a copy
    assert mx.array_equal(ops.sample(strided, words, inv_temperature=1.3),
                          ops.sample(strided + 0, words, inv_temperature=1.3)).item()


def test_every_instruction_set_and_thread_count_draws_the_same_tokens(
        every_isa_and_thread_count: Callable[[], Iterator[tuple[str, int]]]) -> None:
    logprobs = logprobs_of(32, 49152, seed=2, spread=2.0)
    words = mx.array(np.arange(32, dtype=np.uint64) * np.uint64(0xBF58476D1CE4E5B9))
    reference = [draw(logprobs, words, 1.0, f) for f in FILTERS]
    mx.eval(reference)
    for setting in every_isa_and_thread_count():
        for filters, want in zip(FILTERS, reference):
            assert mx.array_equal(draw(logprobs, words, 1.0, filters), want).item(), (setting, filters)


def test_masked_tokens_are_never_drawn_and_a_certain_token_always_is() -> None:
    logprobs = mx.full((1, 500), -mx.inf)
    logprobs[0, 7] = -0.7
    logprobs[0, 300] = -0.7  # a grammar allowing two tokens, half and half
    drawn = {ops.sample(logprobs, mx.array(np.array([w], dtype=np.uint64)), inv_temperature=1.0).item()
             for w in range(0, 2**64 - 1, 2**58)}
    assert drawn == {7, 300}
    certain = mx.full((1, 500), -mx.inf)
    certain[0, 42] = 0.0
    assert ops.sample(certain, mx.array(np.array([2**64 - 1], dtype=np.uint64)), inv_temperature=5.0).item() == 42


def test_frequencies_follow_the_tempered_distribution() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logprobs = mx.array(np.log(probs)[None].repeat(4000, axis=0).astype(np.float32))
    words = mx.array(np.array([step_word(11, i) for i in range(4000)], dtype=np.uint64))
    counts = np.bincount(np.array(ops.sample(logprobs, words, inv_temperature=2.0)), minlength=4)
    tempered = probs**2 / (probs**2).sum()
    assert np.allclose(counts / 4000, tempered, atol=0.03), counts


def test_compiled_matches_eager() -> None:
    logprobs = logprobs_of(4, 300, seed=3, spread=2.0)
    words = mx.array(np.arange(4, dtype=np.uint64))

    def top20(x: mx.array, w: mx.array) -> mx.array:
        return draw(x, w, 0.8, (20, 0.0, 1.0))

    assert mx.array_equal(mx.compile(top20)(logprobs, words), top20(logprobs, words)).item()


@pytest.mark.parametrize(("x", "words", "inv_temperature", "filters", "message"), [
    (mx.zeros((2, 3), dtype=mx.float16), mx.zeros((2,), dtype=mx.uint64), 1.0, (0, 0.0, 1.0), "float32"),
    (mx.zeros((2, 3)), mx.zeros((3,), dtype=mx.uint64), 1.0, (0, 0.0, 1.0), "one per row"),
    (mx.zeros((2, 3)), mx.zeros((2,), dtype=mx.uint32), 1.0, (0, 0.0, 1.0), "uint64"),
    (mx.zeros((2, 3)), mx.zeros((2,), dtype=mx.uint64), 0.0, (0, 0.0, 1.0), "inv_temperature"),
    (mx.zeros((2, 3)), mx.zeros((2,), dtype=mx.uint64), 1.0, (-1, 0.0, 1.0), "top_k"),
    (mx.zeros((2, 3)), mx.zeros((2,), dtype=mx.uint64), 1.0, (0, 1.5, 1.0), "min_p"),
    (mx.zeros((2, 3)), mx.zeros((2,), dtype=mx.uint64), 1.0, (0, 0.0, 0.0), "top_p"),
])
def test_bad_arguments_are_value_errors(x: mx.array, words: mx.array, inv_temperature: float, filters: Filters,
                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        draw(x, words, inv_temperature, filters)


def test_the_native_binding_samples_natively_and_says_so_in_its_fingerprint() -> None:
    native, reference = make_tiny_binding("llama", seed=4, native=True), make_tiny_binding("llama", seed=4)
    assert native.native_sampler and not reference.native_sampler
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    logprobs = logprobs_of(1, 64, seed=4, spread=2.0)
    assert make_sampler(params, 3, native=True)(logprobs, 5).item() == ops.sample(
        logprobs, mx.array(np.array([step_word(3, 5)], dtype=np.uint64)), inv_temperature=1 / 0.9, top_p=0.95).item()
    assert NATIVE_SAMPLER in native.native_ops and NATIVE_SAMPLER not in reference.native_ops


@pytest.mark.parametrize("restart_at", [1, 9])
def test_a_seeded_native_generation_repeats_and_resumes_exactly(restart_at: int) -> None:
    binding = make_tiny_binding("llama", seed=5, native=True)
    prompt = make_prompt(12)
    params = GenerationParams(max_tokens=24, sampling=SamplingParams(temperature=1.0, top_p=0.9, top_k=30, seed=77))
    full = Generation(binding, prompt, params).run().token_ids
    assert len(full) == 24 and Generation(binding, prompt, params).run().token_ids == full
    caches = binding.make_cache()
    binding.prefill(prompt + list(full[:restart_at]), caches)
    resumed = Generation(binding, prompt, params, caches, resume=ResumePoint(full[:restart_at], full[restart_at])).run()
    assert resumed.token_ids == full
