"""The embedded model on the native CPU kernels keeps every exactness the mlx path has.

Batch invariance by construction means a token's logits do not depend on how it was computed:
prefill chunk size, compiled or ordinary decode step, restored or in-memory cache.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxkv_inference import KvScheme, MlxAutoregressiveBinding
from mlxkv_inference.binding import config_fingerprint
from mlxkv_inference.native import layer as native_layer
from tests.test_kv_persistence import persist_mid_generation, run_fresh_process

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the native CPU kernels are Linux-only")

PROMPT = "Write one sentence about the sea, then one about the mountains, and a last one about the sky."


def next_logits(binding: MlxAutoregressiveBinding, prompt: list[int], chunk: int) -> np.ndarray:
    caches = binding.make_cache()
    binding.prefill(prompt[:-1], caches, chunk_size=chunk)
    return np.array(binding.decode(mx.array(prompt[-1:]), caches))


def separate_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers as separate nodes (what runs where the one-node layer does not serve, and what it
    runs inside: tests/test_native_layer.py)."""
    monkeypatch.setattr(native_layer, "_fused_parts", lambda layer: None)


def test_embedded_native_prefill_in_chunks_of_7_or_512_gives_identical_logits(embedded_native: MlxAutoregressiveBinding) -> None:
    prompt = embedded_native.tokenizer.encode(PROMPT)
    assert len(prompt) > 14
    assert np.array_equal(next_logits(embedded_native, prompt, 7), next_logits(embedded_native, prompt, 512))


def test_embedded_native_compiled_step_equals_the_ordinary_step(embedded_native: MlxAutoregressiveBinding) -> None:
    prompt = embedded_native.tokenizer.encode(PROMPT)
    eager, compiled = embedded_native.make_cache(), embedded_native.make_cache()
    embedded_native.prefill(prompt[:-1], eager)
    embedded_native.prefill(prompt[:-1], compiled)
    token = mx.array(prompt[-1:])
    for _ in range(3):
        want = np.array(embedded_native.decode(token, eager))
        got = embedded_native.decode_compiled(token, compiled)
        assert got is not None
        assert np.array_equal(np.array(got), want)
        token = mx.array([int(want.argmax())])


def test_embedded_native_restored_cache_continues_exactly_in_a_fresh_process(
    embedded_native: MlxAutoregressiveBinding, tmp_path: Path
) -> None:
    prompt = embedded_native.tokenizer.encode("The three primary colors are")
    resume, expected = persist_mid_generation(embedded_native, prompt, tmp_path, split=6, tail=8)
    result = run_fresh_process({"kind": "embedded", "cpu_kernels": "native", "directory": str(tmp_path),
                                "prompt": resume, "max_tokens": 8})
    assert result == {"cached": len(resume) - 1, "tokens": expected}


def test_cpu_kernels_choice_is_part_of_the_fingerprint_and_mlx_keeps_the_old_one() -> None:
    config = {"model_type": "llama", "hidden_size": 64}
    old = config_fingerprint(config, KvScheme(), "digest")
    assert config_fingerprint(config, KvScheme(), "digest", "mlx") == old
    assert config_fingerprint(config, KvScheme(), "digest", "native") != old


def test_embedded_native_runs_a_layers_products_of_one_input_together_with_the_same_logits(
    embedded_native: MlxAutoregressiveBinding, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxkv_cpu_kernels import ops

    together = ops.quantized_matmuls
    calls: list[int] = []

    def counted(x: mx.array, ws: list[mx.array], scales: list[mx.array], biases: list[mx.array],
                group_size: int, bits: int) -> list[mx.array]:
        calls.append(len(ws))
        return together(x, ws, scales, biases, group_size, bits)

    def one_by_one(x: mx.array, ws: list[mx.array], scales: list[mx.array], biases: list[mx.array],
                   group_size: int, bits: int) -> list[mx.array]:
        return [ops.quantized_matmul(x, *parts, group_size, bits) for parts in zip(ws, scales, biases, strict=True)]

    prompt = embedded_native.tokenizer.encode(PROMPT)
    separate_nodes(monkeypatch)
    monkeypatch.setattr(ops, "quantized_matmuls", counted)
    fused = next_logits(embedded_native, prompt, 512)
    layers = len(embedded_native.model.model.layers)
    assert calls == [3, 2] * layers * 2  # q, k, v then gate, up in every layer, for the prefill and the step
    monkeypatch.setattr(ops, "quantized_matmuls", one_by_one)
    assert np.array_equal(fused, next_logits(embedded_native, prompt, 512))


def test_embedded_native_attention_reads_the_projections_as_they_come_with_the_same_logits(
    embedded_native: MlxAutoregressiveBinding, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxkv_cpu_kernels import ops

    attend = ops.attend
    attn = embedded_native.model.model.layers[0].self_attn
    widths: list[tuple[int, int, int]] = []  # q, k and v's last dims as the kernel gets them

    def recorded(q: mx.array, k: mx.array, v: mx.array, *args: Any, **kwargs: Any) -> list[mx.array]:
        widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return attend(q, k, v, *args, **kwargs)

    def per_head(q: mx.array, k: mx.array, v: mx.array, *args: Any, **kwargs: Any) -> list[mx.array]:
        hq, hk, hv = (a.reshape(-1, n, a.shape[-1] // n) for a, n in ((q, attn.n_heads), (k, attn.n_kv_heads), (v, attn.n_kv_heads)))
        out, *written = attend(hq, hk, hv, *args, **kwargs)
        return [out.reshape(q.shape), *written]

    prompt = embedded_native.tokenizer.encode(PROMPT)
    separate_nodes(monkeypatch)
    monkeypatch.setattr(ops, "attend", recorded)
    flat = next_logits(embedded_native, prompt, 512)
    projected = (attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0])
    assert set(widths) == {projected}  # every call, prefill and step: no per-head views
    monkeypatch.setattr(ops, "attend", per_head)
    assert np.array_equal(flat, next_logits(embedded_native, prompt, 512))
