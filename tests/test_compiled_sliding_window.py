"""The compiled decode step on sliding-window (rotating) caches: exactly the graph's tokens with the
rings wrapped, and traced over evaluated parameters (a lazy one would be recomputed every step)."""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, SamplingParams
from mlxkv_inference.cache.rotating import RotatingKVCache
from tests.factories import count_graph_forwards, make_prompt, make_tiny_binding

WINDOW = 512
SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.9, seed=7)}


def sliding_binding(native: bool) -> MlxAutoregressiveBinding:
    return make_tiny_binding("gemma3_text", seed=5, native=native, sliding_window=WINDOW)


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("native", [False, True], ids=["mlx", "native"])
def test_compiled_decode_past_the_window_gives_the_graph_s_tokens(native: bool, sampling: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    binding = sliding_binding(native)
    prompt = make_prompt(WINDOW - 20, seed=9)
    params = GenerationParams(max_tokens=60, ignore_eos=True, sampling=SAMPLINGS[sampling])
    graph = Generation(binding, prompt, replace(params, compiled_decode=False)).run()
    graph_steps = count_graph_forwards(binding, "decode", monkeypatch)
    generation = Generation(binding, prompt, params)
    compiled = generation.run()
    assert compiled.token_ids == graph.token_ids
    assert len(graph_steps) <= 1  # at most the step that rode with the prompt's rest; every other one compiled
    rotating = [c for c in generation.caches if isinstance(c, RotatingKVCache)]
    assert rotating and all(c.offset > WINDOW and c.decode_phase() == "ring" for c in rotating)


def test_compiled_step_is_traced_over_evaluated_parameters() -> None:
    binding = sliding_binding(native=True)
    norm: Any = binding.model.model.norm
    norm.weight = norm.weight * 1.0  # lazy, as a parameter widened at load and not yet read is
    assert pending_graph(norm.weight)
    caches = binding.make_cache()
    binding.prefill(make_prompt(12), caches)  # evaluates the caches, not the final norm
    assert pending_graph(norm.weight)
    logits = binding.decode_compiled(mx.array([3]), caches)
    assert logits is not None
    leaves: Any = tree_flatten(binding.model.parameters())  # type: ignore[no-untyped-call]  # mlx leaves it untyped
    assert [name for name, value in leaves if pending_graph(value)] == []


def pending_graph(a: mx.array) -> bool:
    """Whether `a` is still a graph to compute (an evaluated array exports as a lone source node)."""
    out = io.StringIO()
    mx.export_to_dot(out, a)
    return "shape=rectangle" in out.getvalue()
