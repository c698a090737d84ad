"""Bindings for tests that need one component to fail, stall or report what it was asked: real
`MlxAutoregressiveBinding`s (built by `factories.make_tiny_binding(binding_class=...)`) with one
method wrapped."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference.binding import Fed, Interrupt
from mlxkv_inference.cache.factory import LayerCache

GATE_WAIT_S = 60.0  # a gate left closed by a failing test opens by itself


class FailingBinding(MlxAutoregressiveBinding):
    """Decodes `decodes_left` steps, then its decode raises: a component failing under a real engine."""

    decodes_left = 3

    def decode(self, tokens: mx.array, caches: list[LayerCache]) -> mx.array:
        self._tick()
        return super().decode(tokens, caches)

    def decode_compiled(self, token: mx.array, caches: list[LayerCache]) -> mx.array | None:
        self._tick()
        return super().decode_compiled(token, caches)

    def _tick(self) -> None:
        self.decodes_left -= 1
        if self.decodes_left < 0:
            raise RuntimeError("injected decode failure")


class GatedBinding(MlxAutoregressiveBinding):
    """Every prefill waits until the test opens the gate (so requests pile up in the queue): a
    prefill forward, or a batched step a prompt rides in (`Generation.join`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def prefill(self, tokens: Sequence[int], caches: list[LayerCache], chunk_size: int = 512,
                on_chunk: Callable[[int], None] | None = None, interrupt: Interrupt | None = None) -> Fed:
        self.entered.set()
        self.gate.wait(GATE_WAIT_S)
        return super().prefill(tokens, caches, chunk_size, on_chunk, interrupt)

    def decode_batch(self, tokens: mx.array, caches: Sequence[list[LayerCache]],
                     lengths: Sequence[int] | None = None, logits_of: Sequence[int] | None = None) -> mx.array:
        if logits_of is not None and lengths is not None and sum(logits_of) < sum(lengths):
            self.entered.set()
            self.gate.wait(GATE_WAIT_S)
        return super().decode_batch(tokens, caches, lengths, logits_of)


class RecordingBinding(MlxAutoregressiveBinding):
    """Records the chunk size of every prefill it runs."""

    chunks: list[int]

    def prefill(self, tokens: Sequence[int], caches: list[LayerCache], chunk_size: int = 512,
                on_chunk: Callable[[int], None] | None = None, interrupt: Interrupt | None = None) -> Fed:
        self.chunks.append(chunk_size)
        return super().prefill(tokens, caches, chunk_size, on_chunk, interrupt)
