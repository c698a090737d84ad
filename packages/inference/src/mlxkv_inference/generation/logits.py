"""Logits processors: logit bias and repetition, presence and frequency penalties.

Each is a plain callable (recent tokens (n,), logits (1, V)) -> logits, built by a `make_*` factory;
semantics follow mlx-lm's and OpenAI's definitions of the same options.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import mlx.core as mx

from mlxkv_inference.generation.sampling import SamplingParams

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def make_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors.append(make_logit_bias(params.logit_bias))
    if params.repetition_penalty != 1.0:
        processors.append(make_repetition_penalty(params.repetition_penalty, params.repetition_context_size))
    if params.presence_penalty != 0.0:
        processors.append(make_presence_penalty(params.presence_penalty, params.presence_context_size))
    if params.frequency_penalty != 0.0:
        processors.append(make_frequency_penalty(params.frequency_penalty, params.frequency_context_size))
    return processors


def context_window(params: SamplingParams) -> int:
    """How many trailing tokens the penalties look at (0 when none is active)."""
    sizes = [
        params.repetition_context_size if params.repetition_penalty != 1.0 else 0,
        params.presence_context_size if params.presence_penalty != 0.0 else 0,
        params.frequency_context_size if params.frequency_penalty != 0.0 else 0,
    ]
    return max(sizes)


def make_logit_bias(bias: Mapping[int, float]) -> LogitsProcessor:
    indices = mx.array(list(bias.keys()))
    values = mx.array(list(bias.values()), dtype=mx.float32)

    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, indices].add(values)

    return apply


def make_repetition_penalty(penalty: float, context_size: int) -> LogitsProcessor:
    """Sign-aware multiplicative penalty (CTRL) on tokens seen in the last `context_size`."""

    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        recent = tokens[-context_size:]
        selected = logits[:, recent]
        selected = mx.where(selected < 0, selected * penalty, selected / penalty)
        logits[:, recent] = selected
        return logits

    return apply


def make_presence_penalty(penalty: float, context_size: int) -> LogitsProcessor:
    """Subtract `penalty` once from every token seen in the last `context_size`."""

    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        logits[:, tokens[-context_size:]] -= penalty
        return logits

    return apply


def make_frequency_penalty(penalty: float, context_size: int) -> LogitsProcessor:
    """Subtract `penalty` per occurrence of each token in the last `context_size`."""

    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        return logits.at[:, tokens[-context_size:]].subtract(penalty)

    return apply
