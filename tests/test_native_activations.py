"""The native activation kernels (mlxkv-cpu-kernels `swiglu`, `log_softmax` and `rms_norm`) against
MLX's silu(gate) * up, x - logsumexp(x) and `mx.fast.rms_norm`, and the MLP and norm classes they
serve on the native path.

The models' use of them in batched, speculative and compiled steps (and the sampler's) is pinned
by the native tiny models of test_batching.py and test_speculative.py, built through the binding.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest

import mlxkv_inference  # noqa: F401  (loads the BLAS shim before mlx, as the app does)

if sys.platform != "linux":
    pytest.skip("mlxkv-cpu-kernels is a Linux-only package", allow_module_level=True)

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlxkv_cpu_kernels import ops

from mlxkv_inference.native.mlp import NativeSwigluMixin, use_native_swiglu
from mlxkv_inference.native.norm import NATIVE_RMS_NORM, NativeRmsNormMixin, use_native_rms_norm
from tests.factories import make_tiny_binding


def gate_and_up(shape: tuple[int, ...], seed: int, spread: float = 4.0) -> tuple[mx.array, mx.array]:
    keys = mx.random.split(mx.random.key(seed), 2)
    return mx.random.normal(shape, key=keys[0]) * spread, mx.random.normal(shape, key=keys[1])


@pytest.mark.parametrize("shape", [(1, 1536), (8, 1, 1541), (3, 5), (40000,)])
def test_matches_mlx_silu_times_up(shape: tuple[int, ...]) -> None:
    gate, up = gate_and_up(shape, seed=1)
    assert mx.allclose(ops.swiglu(gate, up), nn.silu(gate) * up, rtol=1e-5, atol=1e-6).item()


def test_saturates_like_silu_at_the_ends_of_the_float_range() -> None:
    gate = mx.array([-1e4, -200.0, -88.0, -87.0, -20.0, -0.0, 0.0, 1e-30, 20.0, 87.0, 88.0, 200.0, 1e4])
    got = ops.swiglu(gate, mx.ones_like(gate))
    assert mx.isfinite(got).all().item()
    assert mx.allclose(got, nn.silu(gate), rtol=1e-5, atol=1e-30).item()


def test_an_element_gets_the_same_bits_alone_in_a_batch_or_strided() -> None:
    gate, up = gate_and_up((9, 1536), seed=2)
    together = ops.swiglu(gate, up)
    for row in (0, 4, 8):
        assert mx.array_equal(ops.swiglu(gate[row : row + 1], up[row : row + 1]), together[row : row + 1]).item()
    transposed = ops.swiglu(gate.T, up.T)  # strided inputs are read in place of a copy
    assert mx.array_equal(transposed, together.T).item()


def test_every_instruction_set_and_thread_count_gives_the_same_bits(
        every_isa_and_thread_count: Callable[[], Iterator[tuple[str, int]]]) -> None:
    gate, up = gate_and_up((64, 1541), seed=3)  # enough elements to split over threads, and a tail
    logits = gate * 3
    weight = up[0]
    reference = [ops.swiglu(gate, up), ops.log_softmax(logits), ops.rms_norm(gate, weight, 1e-5)]
    mx.eval(reference)
    for setting in every_isa_and_thread_count():
        assert mx.array_equal(ops.swiglu(gate, up), reference[0]).item(), setting
        assert mx.array_equal(ops.log_softmax(logits), reference[1]).item(), setting
        assert mx.array_equal(ops.rms_norm(gate, weight, 1e-5), reference[2]).item(), setting


@pytest.mark.parametrize("shape", [(1, 49152), (8, 1000), (3, 5), (17,)])
def test_log_softmax_matches_mlx(shape: tuple[int, ...]) -> None:
    logits = mx.random.normal(shape, key=mx.random.key(6)) * 8
    reference = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    got = ops.log_softmax(logits)
    assert mx.allclose(got, reference, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(reference, axis=-1)).item()


def test_log_softmax_rows_are_their_own_and_masked_tokens_stay_minus_infinity() -> None:
    logits = mx.random.normal((9, 1000), key=mx.random.key(7)) * 8
    logits[2, 10:500] = -mx.inf  # a grammar mask
    together = ops.log_softmax(logits)
    for row in (0, 2, 8):
        assert mx.array_equal(ops.log_softmax(logits[row : row + 1]), together[row : row + 1]).item()
    strided = mx.random.normal((4, 2000), key=mx.random.key(8))[:, ::2]  # read in place of a copy
    assert mx.array_equal(ops.log_softmax(strided), ops.log_softmax(strided + 0)).item()
    assert (together[2, 10:500] == -mx.inf).all().item()
    assert mx.allclose(mx.exp(together).sum(axis=-1), mx.ones((9,)), atol=1e-5).item()


@pytest.mark.parametrize(("shape", "eps", "spread"), [
    ((1, 576), 1e-5, 4.0), ((8, 1, 576), 1e-5, 4.0), ((3, 37), 1e-6, 4.0), ((2, 4, 64), 1e-6, 4.0), ((5,), 0.0, 4.0),
    ((4, 576), 1e-5, 1e-3),  # mean(x * x) ~ 1e-6: where eps goes decides the result
])
def test_rms_norm_matches_mlx(shape: tuple[int, ...], eps: float, spread: float) -> None:
    x, up = gate_and_up(shape, seed=9, spread=spread)
    weight = up.reshape(-1, shape[-1])[0]
    assert mx.allclose(ops.rms_norm(x, weight, eps), mx.fast.rms_norm(x, weight, eps), rtol=1e-5, atol=1e-6).item()


def test_rms_norm_rows_are_their_own_and_strided_input_is_read_in_place() -> None:
    x, up = gate_and_up((9, 576), seed=10)
    weight = up[0]
    together = ops.rms_norm(x, weight, 1e-5)
    for row in (0, 4, 8):
        assert mx.array_equal(ops.rms_norm(x[row : row + 1], weight, 1e-5), together[row : row + 1]).item()
    wide = mx.concatenate([x, x], axis=1)[:, ::2]  # strided rows: gathered, the same values
    assert mx.array_equal(ops.rms_norm(wide, weight, 1e-5), ops.rms_norm(wide + 0, weight, 1e-5)).item()
    assert mx.array_equal(ops.rms_norm(x, mx.concatenate([weight, weight])[::2], 1e-5),
                          ops.rms_norm(x, mx.concatenate([weight, weight])[::2] + 0, 1e-5)).item()
    assert mx.array_equal(ops.rms_norm(mx.zeros((2, 32)), mx.ones((32,)), 1e-5), mx.zeros((2, 32))).item()


def test_compiled_matches_eager() -> None:
    gate, up = gate_and_up((4, 96), seed=4)
    assert mx.array_equal(mx.compile(ops.swiglu)(gate, up), ops.swiglu(gate, up)).item()
    assert mx.array_equal(mx.compile(ops.log_softmax)(gate), ops.log_softmax(gate)).item()

    def norm(x: mx.array, w: mx.array) -> mx.array:
        return ops.rms_norm(x, w, 1e-5)

    assert mx.array_equal(mx.compile(norm)(gate, up[0]), norm(gate, up[0])).item()


@pytest.mark.parametrize(("gate", "up", "message"), [
    (mx.zeros((2, 3), dtype=mx.float16), mx.zeros((2, 3), dtype=mx.float16), "float32"),
    (mx.zeros((2, 3)), mx.zeros((3, 2)), "same shape"),
])
def test_bad_arguments_are_value_errors(gate: mx.array, up: mx.array, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ops.swiglu(gate, up)
    with pytest.raises(ValueError, match="float32"):
        ops.log_softmax(mx.zeros((2, 3), dtype=mx.float16))


@pytest.mark.parametrize(("x", "weight", "eps", "message"), [
    (mx.zeros((2, 3), dtype=mx.float16), mx.ones((3,)), 1e-5, "float32"),
    (mx.zeros((2, 3)), mx.ones((4,)), 1e-5, "shape"),
    (mx.zeros((2, 3)), mx.ones((1, 3)), 1e-5, "shape"),
    (mx.zeros((2, 3)), mx.ones((3,)), -1.0, "eps"),
])
def test_rms_norm_bad_arguments_are_value_errors(x: mx.array, weight: mx.array, eps: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ops.rms_norm(x, weight, eps)


def test_llama_mlps_get_the_kernel_and_keep_their_weights() -> None:
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=48,
                           num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=64, num_key_value_heads=2)
    model = llama.Model(args)
    mx.eval(model.parameters())  # type: ignore[no-untyped-call]  # mlx leaves it untyped
    x = mx.random.normal((1, 3, 32), key=mx.random.key(5))
    before = model.model.layers[0].mlp(x)
    assert use_native_swiglu(model)
    mlp = model.model.layers[1].mlp
    assert isinstance(mlp, llama.MLP) and type(mlp) is not llama.MLP
    assert mx.allclose(model.model.layers[0].mlp(x), before, rtol=1e-5, atol=1e-6).item()
    assert not use_native_swiglu(nn.Linear(2, 2))


def test_rms_norms_get_the_kernel_and_float16_keeps_mlx() -> None:
    norm = nn.RMSNorm(48, eps=1e-6)
    norm.weight = mx.random.normal((48,), key=mx.random.key(11))
    x = mx.random.normal((2, 3, 48), key=mx.random.key(12))
    before = norm(x)
    assert use_native_rms_norm(norm)
    assert isinstance(norm, NativeRmsNormMixin) and isinstance(norm, nn.RMSNorm)
    assert mx.allclose(norm(x), before, rtol=1e-5, atol=1e-6).item()
    assert mx.array_equal(norm(x), ops.rms_norm(x, norm.weight, 1e-6)).item()
    half = x.astype(mx.float16)
    assert mx.array_equal(norm(half), mx.fast.rms_norm(half, norm.weight, 1e-6)).item()
    assert not use_native_rms_norm(nn.Linear(2, 2))
    bf16 = nn.RMSNorm(48)
    bf16.set_dtype(mx.bfloat16)
    assert not use_native_rms_norm(bf16) and not isinstance(bf16, NativeRmsNormMixin)  # float32 weights only


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_native_binding_gives_its_mlps_and_norms_the_kernels(kind: str) -> None:
    binding = make_tiny_binding(kind, seed=4, native=True)
    layers = getattr(binding.model, "model").layers
    assert all(isinstance(layer.mlp, NativeSwigluMixin) for layer in layers)
    assert all(isinstance(layer.input_layernorm, NativeRmsNormMixin) for layer in layers)
    assert isinstance(getattr(binding.model, "model").norm, NativeRmsNormMixin)
    if kind == "qwen3":
        assert all(isinstance(layer.self_attn.q_norm, NativeRmsNormMixin) for layer in layers)
    assert NATIVE_RMS_NORM in binding.native_ops
    assert NATIVE_RMS_NORM not in make_tiny_binding(kind, seed=4).native_ops
    assert make_tiny_binding(kind, seed=4).config_fingerprint != binding.config_fingerprint
