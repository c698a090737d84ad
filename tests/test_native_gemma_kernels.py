"""The native GeGLU (mlxkv-cpu-kernels `geglu`) against MLX's `nn.gelu_approx(gate) * up`, and Gemma 3's
MLP and RMSNorm classes on the native path (GeGLU, and the native `rms_norm` with `1 + weight`).

The real model's greedy text and batched, speculative and compiled steps on these kernels are pinned by
test_gemma3_real.py, test_gemma3_paths.py, test_rotating_rounds.py and test_compiled_sliding_window.py.
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
import mlx.nn as nn
from mlx_lm.models import gemma3_text
from mlxkv_cpu_kernels import ops

from mlxkv_inference.native.mlp import NATIVE_GEGLU, NativeGegluMixin, use_native_geglu
from mlxkv_inference.native.norm import NATIVE_GEMMA_RMS_NORM, NativeGemmaRmsNormMixin, use_native_gemma_rms_norm
from tests.factories import make_tiny_binding

# The bound activations.h states: |geglu - mlx| <= 2^-21 * |gate * up| + 2^-149.
RELATIVE_BOUND = 2.0**-21
ABSOLUTE_FLOOR = 2.0**-149
EDGES = [0.0, -0.0, 1e-40, -1e-40, 1e-30, -1e-30, 0.5, -0.5, 3.0, -3.0, -5.5, -10.0, -20.0, 44.0, -44.0, 88.0, -88.0,
         1e4, -1e4, 1e13, -1e13, 1e30, -1e30, 3e38, -3e38]


def gate_and_up(shape: tuple[int, ...], seed: int, spread: float = 4.0) -> tuple[mx.array, mx.array]:
    keys = mx.random.split(mx.random.key(seed), 2)
    return mx.random.normal(shape, key=keys[0]) * spread, mx.random.normal(shape, key=keys[1])


def geglu_error(gate: mx.array, up: mx.array) -> float:
    """max |geglu - MLX's| / (2^-21 * |gate * up| + 2^-149): at most 1 within the stated bound."""
    ours = np.array(ops.geglu(gate, up), dtype=np.float64)
    mlx = np.array(nn.gelu_approx(gate) * up, dtype=np.float64)
    scale = np.abs(np.array(gate, dtype=np.float64) * np.array(up, dtype=np.float64))
    return float((np.abs(ours - mlx) / (RELATIVE_BOUND * scale + ABSOLUTE_FLOOR)).max())


@pytest.mark.parametrize(("shape", "spread"), [((1, 2048), 4.0), ((9, 1, 2048), 4.0), ((3, 5), 4.0), ((40001,), 8.0),
                                               ((7, 33), 100.0), ((4000,), 1e-3)])
def test_geglu_is_within_its_stated_bound_of_mlx_gelu_approx_times_up(shape: tuple[int, ...], spread: float) -> None:
    gate, up = gate_and_up(shape, seed=1, spread=spread)
    assert geglu_error(gate, up) <= 1.0


def test_geglu_at_the_edges_of_the_float_range_is_mlx_s_value_or_within_the_bound() -> None:
    gate = mx.array(EDGES)
    up = mx.ones_like(gate)
    got = ops.geglu(gate, up)
    assert mx.isfinite(got).all().item()
    assert geglu_error(gate, up) <= 1.0
    # Far from 0 the float answer is exact: the gate itself above, -0 below (as MLX gives).
    high = mx.array([EDGES.index(g) for g in (44.0, 88.0, 1e4, 1e13, 1e30, 3e38)])
    low = mx.array([EDGES.index(g) for g in (-20.0, -44.0, -88.0, -1e4, -1e13, -1e30, -3e38)])
    assert mx.array_equal(got[high], gate[high]).item()
    assert mx.array_equal(got[low], nn.gelu_approx(gate[low])).item() and (got[low] == 0).all().item()
    assert ops.geglu(mx.zeros((17,)), mx.ones((17,))).tolist() == [0.0] * 17


def test_geglu_stays_close_to_tanh_gelu_in_float64() -> None:
    gate, up = gate_and_up((20000,), seed=2, spread=6.0)
    g = np.array(gate, dtype=np.float64)
    exact = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * np.array(up, dtype=np.float64)
    error = np.abs(np.array(ops.geglu(gate, up), dtype=np.float64) - exact)
    assert (error <= 2.0**-22 * np.abs(g * np.array(up, dtype=np.float64)) + ABSOLUTE_FLOOR).all()


@pytest.mark.parametrize("width", [2048, 1541, 7])
def test_geglu_rows_get_the_same_bits_alone_stacked_or_strided(width: int) -> None:
    gate, up = gate_and_up((9, width), seed=3)
    together = ops.geglu(gate, up)
    for row in (0, 4, 8):
        assert mx.array_equal(ops.geglu(gate[row : row + 1], up[row : row + 1]), together[row : row + 1]).item()
    assert mx.array_equal(ops.geglu(gate[3:8], up[3:8]), together[3:8]).item()  # odd counts, odd offsets
    assert mx.array_equal(ops.geglu(gate.T, up.T), together.T).item()  # strided inputs read in place of a copy


def test_geglu_gives_the_same_bits_on_every_instruction_set_and_thread_count(
        every_isa_and_thread_count: Callable[[], Iterator[tuple[str, int]]]) -> None:
    gate, up = gate_and_up((64, 1541), seed=4, spread=6.0)  # enough elements to split over threads, and a tail
    reference = ops.geglu(gate, up)
    mx.eval(reference)
    for setting in every_isa_and_thread_count():
        assert mx.array_equal(ops.geglu(gate, up), reference).item(), setting


def test_geglu_compiled_matches_eager_and_bad_arguments_are_value_errors() -> None:
    gate, up = gate_and_up((4, 96), seed=5)
    assert mx.array_equal(mx.compile(ops.geglu)(gate, up), ops.geglu(gate, up)).item()
    with pytest.raises(ValueError, match="geglu: gate and up must be float32"):
        ops.geglu(gate.astype(mx.float16), up.astype(mx.float16))
    with pytest.raises(ValueError, match="geglu: gate and up must have the same shape"):
        ops.geglu(gate, up.T)


def make_gemma_layer(seed: int = 6) -> gemma3_text.TransformerBlock:
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=1, intermediate_size=96,
                                 num_attention_heads=4, head_dim=32, num_key_value_heads=2, vocab_size=64)
    layer = gemma3_text.TransformerBlock(args, 0)
    keys = iter(mx.random.split(mx.random.key(seed), 16))
    layer.update({"mlp": {name: {"weight": mx.random.normal(getattr(layer.mlp, name).weight.shape, key=next(keys)) * 0.2}
                          for name in ("gate_proj", "up_proj", "down_proj")}})
    for norm in (layer.input_layernorm, layer.post_feedforward_layernorm, layer.self_attn.q_norm):
        norm.weight = mx.random.normal(norm.weight.shape, key=next(keys))
    mx.eval(layer.parameters())  # type: ignore[no-untyped-call]  # mlx leaves it untyped
    return layer


def test_gemma_mlps_get_the_geglu_kernel_and_keep_their_weights() -> None:
    layer = make_gemma_layer()
    x = mx.random.normal((9, 1, 64), key=mx.random.key(7))
    before = layer.mlp(x)
    assert use_native_geglu(layer)
    mlp = layer.mlp
    assert isinstance(mlp, NativeGegluMixin) and isinstance(mlp, gemma3_text.MLP)
    assert mx.array_equal(mlp(x), mlp.down_proj(ops.geglu(mlp.gate_proj(x), mlp.up_proj(x)))).item()
    assert mx.allclose(mlp(x), before, rtol=1e-4, atol=1e-5).item()
    assert mx.array_equal(mlp(x[2:7]), mlp(x)[2:7]).item()  # a row's output is its own
    mlp.set_dtype(mx.float16)  # float16 activations keep MLX's gelu_approx
    half = x.astype(mx.float16)
    assert mx.array_equal(mlp(half), mlp.down_proj(nn.gelu_approx(mlp.gate_proj(half)) * mlp.up_proj(half))).item()
    assert not use_native_geglu(nn.Linear(2, 2))


@pytest.mark.parametrize("shape", [(1, 64), (9, 1, 64), (5, 37)])
def test_gemma_rms_norm_matches_mx_fast_rms_norm_with_one_plus_weight(shape: tuple[int, ...]) -> None:
    norm = gemma3_text.RMSNorm(shape[-1], eps=1e-6)
    norm.weight = mx.random.normal((shape[-1],), key=mx.random.key(8))
    x = mx.random.normal(shape, key=mx.random.key(9)) * 4
    before = norm(x)
    assert use_native_gemma_rms_norm(norm)
    assert isinstance(norm, NativeGemmaRmsNormMixin)
    source, plus_one = norm.__dict__["_plus_one"]  # computed once, for the weight the norm has
    assert source is norm["weight"] and mx.array_equal(plus_one, 1.0 + norm.weight).item()
    assert mx.array_equal(norm(x), ops.rms_norm(x, 1.0 + norm.weight, 1e-6)).item()
    assert mx.allclose(norm(x), before, rtol=1e-5, atol=1e-6).item()
    assert mx.array_equal(norm(x[1:]), norm(x)[1:]).item()  # a row's output is its own


def test_gemma_q_and_k_norms_normalize_each_head_and_block_norms_each_row() -> None:
    layer = make_gemma_layer()
    x = mx.random.normal((7, 4, 32), key=mx.random.key(10))  # (rows, heads, head dim), as attention norms q
    h = mx.random.normal((7, 1, 64), key=mx.random.key(11))
    before_q, before_h = layer.self_attn.q_norm(x), layer.input_layernorm(h)
    assert use_native_gemma_rms_norm(layer)
    assert all(isinstance(norm, NativeGemmaRmsNormMixin) for norm in (
        layer.self_attn.q_norm, layer.self_attn.k_norm, layer.input_layernorm, layer.post_attention_layernorm,
        layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm))
    assert mx.allclose(layer.self_attn.q_norm(x), before_q, rtol=1e-5, atol=1e-6).item()
    assert mx.allclose(layer.input_layernorm(h), before_h, rtol=1e-5, atol=1e-6).item()
    for a, b in ((0, 1), (2, 7), (3, 6)):
        assert mx.array_equal(layer.self_attn.q_norm(x[a:b]), layer.self_attn.q_norm(x)[a:b]).item()
        assert mx.array_equal(layer.input_layernorm(h[a:b]), layer.input_layernorm(h)[a:b]).item()


def test_gemma_rms_norm_follows_weights_replaced_after_install_and_keeps_mlx_for_float16() -> None:
    norm = gemma3_text.RMSNorm(48, eps=1e-6)
    assert use_native_gemma_rms_norm(norm)
    x = mx.random.normal((3, 48), key=mx.random.key(12))
    norm.weight = mx.random.normal((48,), key=mx.random.key(13))
    assert mx.array_equal(norm(x), ops.rms_norm(x, 1.0 + norm.weight, 1e-6)).item()
    assert "_plus_one" not in dict(norm.parameters())  # type: ignore[no-untyped-call]  # not saved or digested
    half = x.astype(mx.float16)
    assert mx.array_equal(norm(half), mx.fast.rms_norm(half, 1.0 + norm.weight, 1e-6)).item()
    bf16 = gemma3_text.RMSNorm(48)
    bf16.set_dtype(mx.bfloat16)
    assert not use_native_gemma_rms_norm(bf16) and not isinstance(bf16, NativeGemmaRmsNormMixin)


def test_the_native_gemma_binding_gives_its_mlps_and_norms_the_kernels() -> None:
    binding = make_tiny_binding("gemma3_text", seed=4, native=True)
    inner = getattr(binding.model, "model")
    assert all(isinstance(layer.mlp, NativeGegluMixin) for layer in inner.layers)
    assert all(isinstance(layer.self_attn.k_norm, NativeGemmaRmsNormMixin) for layer in inner.layers)
    assert isinstance(inner.norm, NativeGemmaRmsNormMixin)
    assert {NATIVE_GEGLU, NATIVE_GEMMA_RMS_NORM} <= set(binding.native_ops)
    plain = make_tiny_binding("gemma3_text", seed=4)
    assert not {NATIVE_GEGLU, NATIVE_GEMMA_RMS_NORM} & set(plain.native_ops)
    assert plain.config_fingerprint != binding.config_fingerprint
    llama_layers = getattr(make_tiny_binding("llama", seed=4, native=True).model, "model").layers
    assert not any(isinstance(layer.mlp, NativeGegluMixin) for layer in llama_layers)
