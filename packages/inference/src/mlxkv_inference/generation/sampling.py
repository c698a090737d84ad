"""Sampling parameters and the seeded sampler.

The randomness of step i is derived from (seed, i) alone, never from a running random state, so a
generation restarted at step k with the same seed and history continues with exactly the tokens
the uninterrupted run produced. On the native path one kernel filters and draws (an inverse CDF
over the step's 64-bit word; MLX's filters and Gumbel draw are several ops a row on the CPU, and
top-p sorts the whole vocabulary: `tools.bench_sampler`); elsewhere mlx-lm's filters and MLX's
categorical draw with the step's key. Both sample the same distribution, not the same tokens.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxkv_inference import _mlx_lm

# (logprobs (1, V), step index) -> token (1,)
Sampler = Callable[[mx.array, int], mx.array]

_MASK64 = (1 << 64) - 1
# Below this temperature sampling is argmax to float32 precision, and 1/T (or logprobs times it)
# would overflow float32 into inf and NaN: such a temperature samples greedily.
GREEDY_BELOW = 1e-20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and penalty settings; defaults are greedy decoding with no penalties."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None

    def __post_init__(self) -> None:
        _check(self.temperature >= 0 and math.isfinite(self.temperature), "temperature", self.temperature, ">= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "(0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 disables)")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "[0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0 (1 disables)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, value, "[-2, 2]")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        if self.seed is not None:
            _check(0 <= self.seed <= _MASK64, "seed", self.seed, f"[0, {_MASK64}]")
        for token, bias in self.logit_bias.items():
            _check(token >= 0, "logit_bias token id", token, ">= 0")
            _check(math.isfinite(bias), "logit_bias value", bias, "a finite number")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def choose_seed() -> int:
    """A fresh random seed for a request that did not give one (it is reported back)."""
    return secrets.randbits(63)


def step_word(seed: int, step: int) -> int:
    """The 64 random bits of decode step `step` of a generation seeded with `seed`."""
    return _splitmix64(_splitmix64(seed) ^ step)


def step_key(seed: int, step: int) -> mx.array:
    """The PRNG key for decode step `step` of a generation seeded with `seed`."""
    return mx.random.key(step_word(seed, step) >> 1)


def make_sampler(params: SamplingParams, seed: int, native: bool = False) -> Sampler:
    """A sampler over log-probabilities: greedy at temperature 0, else filtered categorical
    (`native`: the native kernel's, see the module docstring)."""
    if params.is_greedy:
        return _greedy
    inv_temp = 1.0 / params.temperature
    if native:
        from mlxkv_cpu_kernels import ops

        def sample_native(logprobs: mx.array, step: int) -> mx.array:
            words = mx.array(np.array([step_word(seed, step)], dtype=np.uint64))
            top_k = params.top_k if params.top_k < logprobs.shape[-1] else 0
            out: mx.array = ops.sample(logprobs.astype(mx.float32), words, inv_temperature=inv_temp, top_k=top_k,
                                       top_p=params.top_p, min_p=params.min_p)
            return out

        return sample_native

    def sample(logprobs: mx.array, step: int) -> mx.array:
        if params.top_k > 0 and params.top_k < logprobs.shape[-1]:
            logprobs = _mlx_lm.apply_top_k(logprobs, params.top_k)
        if params.min_p > 0:
            logprobs = _mlx_lm.apply_min_p(logprobs, params.min_p)
        if params.top_p < 1:
            logprobs = _mlx_lm.apply_top_p(logprobs, params.top_p)
        return mx.random.categorical(logprobs * inv_temp, key=step_key(seed, step))

    return sample


def _greedy(logprobs: mx.array, step: int) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range; allowed: {allowed}")
