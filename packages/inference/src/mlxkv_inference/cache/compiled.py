"""The compiled decode step: one token, or a speculative round's positions (plain and sliding-window caches).

One `mx.compile`d function runs embed -> layers -> norm -> logits with every layer's cache
replaced by a stand-in (`cache/stand_ins.py`). Buffers, RoPE offsets and ring write positions are inputs, so the
trace is reused across steps and generations; it is keyed by the caches' (signature, phase) and
the positions fed, and MLX retraces by itself only when an input shape changes (a buffer grew).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference import _mlx_lm
from mlxkv_inference.cache.contract import DecodeStandIn
from mlxkv_inference.cache.factory import LayerCache

log = logging.getLogger(__name__)

StepKey = tuple[int, tuple[tuple[str, str, int], ...]]
StepFn = Callable[..., list[mx.array]]


class CompiledDecoder:
    """Holds the compiled steps of one model, keyed by the caches' signatures and phases."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._steps: dict[StepKey, tuple[StepFn, list[int]]] = {}
        self._shapes: set[int] = set()  # hashes of the (step, its inputs' shapes) run (a timing hint: no more)
        self.traced = False  # whether the last `step` traced (a new step, or inputs of new shapes)

    @property
    def num_traces(self) -> int:
        return len(self._steps)

    def clear(self) -> None:
        self._steps.clear()
        self._shapes.clear()

    def step(self, tokens: mx.array, caches: Sequence[LayerCache]) -> mx.array | None:
        """(L, vocab) logits of feeding the L `tokens`, or None when some cache cannot run
        compiled yet (or not L positions at once).

        `prepare_decode_step` may grow or rotate a cache's buffers (eagerly, keeping its tokens);
        the tokens themselves are written only in `commit_decode_step`, after the compiled call
        returned, so an exception from the step leaves each cache holding the same tokens at the
        same offset, which is all the uncompiled path needs.
        """
        self.traced = False
        rows = int(tokens.size)
        plans = [c.prepare_decode_step(rows) for c in caches]
        if any(p is None for p in plans):
            return None
        ready = [(c, p) for c, p in zip(caches, plans) if p is not None]
        inputs = [c.decode_inputs(p) for c, p in ready]
        key: StepKey = (rows, tuple((c.signature(), p.phase, len(i)) for (c, p), i in zip(ready, inputs)))
        if key not in self._steps:
            stand_ins: list[DecodeStandIn] = [c.decode_stand_in(p) for c, p in ready]
            self._steps[key] = (self._build(stand_ins, [len(i) for i in inputs]), [s.num_outputs for s in stand_ins])
        fn, counts = self._steps[key]
        shapes = hash((key, tuple(tuple(a.shape) for group in inputs for a in group)))
        self.traced = shapes not in self._shapes  # MLX traces a call whose input shapes are new
        self._shapes.add(shapes)
        outputs = fn(tokens.reshape(1, rows), *(a for group in inputs for a in group))
        logits, rest = outputs[0], outputs[1:]
        for (cache, plan), n in zip(ready, counts):
            cache.commit_decode_step(plan, rest[:n])
            rest = rest[n:]
        return logits

    def _build(self, stand_ins: list[DecodeStandIn], sizes: list[int]) -> StepFn:
        model = self._model
        # NOTE: a parameter still lazy when traced (widened to 8 bits or float32 at load, and not
        # yet read by a forward whose logits were evaluated) is traced with the graph that makes
        # it, and recomputed by every call (Gemma 3's last layer after a prefill, which evaluates only
        # what the caches need: see docs/benchmarks.md).
        _mlx_lm.eval_parameters(model)

        def run(tokens: mx.array, *flat: mx.array) -> list[mx.array]:
            at = 0
            for stand_in, n in zip(stand_ins, sizes):
                stand_in.bind(list(flat[at : at + n]))
                at += n
            logits = _mlx_lm.forward(model, tokens, list(stand_ins))[0]
            if logits.dtype != mx.float32:
                logits = logits.astype(mx.float32)
            return [logits, *(o for stand_in in stand_ins for o in stand_in.outputs())]

        compiled: StepFn = mx.compile(run)
        return compiled

