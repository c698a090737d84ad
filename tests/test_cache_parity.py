"""Every cache kind against mlx-lm, compiled decode against the ordinary graph, and exact
rollback of a speculative round on a hybrid model."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from mlxkv_inference import Generation, GenerationParams, KvScheme, MlxAutoregressiveBinding
from mlxkv_inference._mlx_lm import mlx_lm_step_tokens
from mlxkv_inference.cache.quantized import QuantizedKVCache
from mlxkv_inference.cache.rounds import Round
from tests.factories import greedy_token, make_prompt, make_tiny_binding

# head_dim 64 so the tiny model's keys split into whole quantization groups.
QUANT_MODEL: dict[str, Any] = {"head_dim": 64}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("start", [0, 30])
def test_quantized_kv_greedy_matches_mlx_lm(bits: int, start: int) -> None:
    scheme = KvScheme(bits=bits, group_size=32, quantized_start=start)
    binding = make_tiny_binding("llama", kv_scheme=scheme, **QUANT_MODEL)
    prompt = make_prompt(20)
    generation = Generation(binding, prompt, GenerationParams(max_tokens=48, ignore_eos=True))
    ours = generation.run().token_ids
    theirs = mlx_lm_step_tokens(
        binding.model, prompt, 48, prefill_step_size=512, kv_bits=bits, kv_group_size=32, quantized_kv_start=start
    )
    assert list(ours) == theirs
    assert all(isinstance(c, QuantizedKVCache) for c in generation.caches)


def decode_both_ways(binding: MlxAutoregressiveBinding, prompt: list[int], steps: int) -> list[tuple[mx.array, mx.array]]:
    """Logits of `steps` greedy decode steps, uncompiled and compiled, on twin caches."""
    plain, compiled = binding.make_cache(), binding.make_cache()
    binding.prefill(prompt[:-1], plain)
    binding.prefill(prompt[:-1], compiled)
    token = mx.array(prompt[-1:])
    pairs = []
    for _ in range(steps):
        a = binding.decode(token, plain)
        b = binding.decode_compiled(token, compiled)
        assert b is not None
        mx.eval(a, b)
        pairs.append((a, b))
        token = mx.argmax(a, axis=-1)
    return pairs


@pytest.mark.parametrize(
    ("kind", "scheme", "overrides"),
    [
        ("llama", KvScheme(), {}),
        ("gemma3_text", KvScheme(), {}),  # window 8: the ring wraps after 4 of the 100 steps
        ("qwen3_next", KvScheme(), {}),
        ("llama", KvScheme(bits=4, group_size=32, quantized_start=0), QUANT_MODEL),
        ("llama", KvScheme(bits=8, group_size=32, quantized_start=40), QUANT_MODEL),
    ],
    ids=["plain", "rotating", "recurrent", "quantized4", "quantized8-converts-mid-decode"],
)
def test_compiled_decode_logits_are_bit_identical(kind: str, scheme: KvScheme, overrides: dict[str, Any]) -> None:
    binding = make_tiny_binding(kind, kv_scheme=scheme, **overrides)
    pairs = decode_both_ways(binding, make_prompt(5), 100)
    mismatched = [i for i, (a, b) in enumerate(pairs) if not mx.array_equal(a, b).item()]
    assert mismatched == []


def test_compiled_trace_is_reused_across_steps_and_generations() -> None:
    binding = make_tiny_binding("llama")
    for seed in (1, 2):
        Generation(binding, make_prompt(12, seed=seed), GenerationParams(max_tokens=40)).run()
    assert binding.compiled_traces == 1


def test_failing_compiled_step_falls_back_without_corrupting_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    binding = make_tiny_binding("gemma3_text")
    prompt = make_prompt(6)
    reference = Generation(binding, prompt, GenerationParams(max_tokens=30, compiled_decode=False)).run().token_ids
    calls = 0
    real = binding.decode_compiled

    def flaky(token: mx.array, caches: Any) -> mx.array | None:
        nonlocal calls
        calls += 1
        if calls == 5:
            for cache in caches:
                cache.prepare_decode_step()  # caches are touched, as a real failure would leave them
            raise RuntimeError("trace failed")
        return real(token, caches)

    monkeypatch.setattr(binding, "decode_compiled", flaky)
    assert Generation(binding, prompt, GenerationParams(max_tokens=30)).run().token_ids == reference
    assert calls == 5


def greedy_continue(binding: MlxAutoregressiveBinding, caches: Any, token: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = greedy_token(binding.decode(mx.array([token]), caches))
        out.append(token)
    return out


def test_recurrent_speculative_rollback_equals_never_speculating() -> None:
    binding = make_tiny_binding("qwen3_next")
    prompt = make_prompt(10)
    draft = [11, 22, 33, 44]

    reference = binding.make_cache()
    binding.prefill(prompt, reference)
    for token in draft[:2]:
        binding.decode(mx.array([token]), reference)
    reference_offsets = [c.offset for c in reference]
    expected = greedy_continue(binding, reference, draft[1], 8)

    caches = binding.make_cache()
    binding.prefill(prompt, caches)
    spec = Round(caches, len(draft))
    binding.prefill(draft, caches)  # the verify pass feeds the whole draft at once
    spec.keep(2, draft, binding.feed)
    assert [c.offset for c in caches] == reference_offsets
    assert greedy_continue(binding, caches, draft[1], 8) == expected
