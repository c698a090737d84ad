"""The native quantized matmul (mlxkv-cpu-kernels): agreement with MLX and batch invariance.

Model-free: random weights quantized with `mx.quantize`. Linux only (the package is a Linux
dependency); there the extension must import, so a broken build fails here instead of skipping.
"""

from __future__ import annotations

import sys

import pytest

import mlxkv_inference  # noqa: F401  (loads the BLAS shim before mlx, as the app does)

if sys.platform != "linux":
    pytest.skip("mlxkv-cpu-kernels is a Linux-only package", allow_module_level=True)

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlxkv_cpu_kernels import blas_status, ops, split_blas_products


def quantized(n: int, k: int, group_size: int, bits: int, scale_dtype: mx.Dtype, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    weight = mx.random.normal((n, k), key=mx.random.key(seed))
    w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    return w, scales.astype(scale_dtype), biases.astype(scale_dtype)


def rows(m: int, k: int, seed: int) -> mx.array:
    return mx.random.normal((m, k), key=mx.random.key(seed))


def as_numpy(a: mx.array) -> np.ndarray:
    return np.array(a)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16])
def test_native_matches_mx_quantized_matmul(bits: int, group_size: int, scale_dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(bits * 1000 + group_size)
    for trial in range(3):
        n = int(rng.integers(1, 300))
        k = group_size * int(rng.integers(1, 12))
        m = int(rng.integers(1, 40))
        w, scales, biases = quantized(n, k, group_size, bits, scale_dtype, seed=trial)
        x = rows(m, k, seed=100 + trial)
        want = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
        got = ops.quantized_matmul(x, w, scales, biases, group_size, bits)
        assert got.shape == (m, n) and got.dtype == mx.float32
        # Only the float summation order differs: fp32 rounding over K terms of size |x||w|.
        bound = 1e-6 * k * float(np.abs(as_numpy(x)).max()) * (float(np.abs(as_numpy(want)).max()) + 1.0)
        np.testing.assert_allclose(as_numpy(got), as_numpy(want), rtol=0, atol=bound)


def test_one_and_three_dimensional_inputs_keep_leading_shape() -> None:
    w, scales, biases = quantized(40, 128, 32, 4, mx.float16, seed=1)
    x3 = mx.random.normal((2, 5, 128), key=mx.random.key(2))
    y3 = ops.quantized_matmul(x3, w, scales, biases, 32, 4)
    assert y3.shape == (2, 5, 40)
    flat = ops.quantized_matmul(x3.reshape(10, 128), w, scales, biases, 32, 4)
    assert np.array_equal(as_numpy(y3.reshape(10, 40)), as_numpy(flat))
    y1 = ops.quantized_matmul(x3[1, 3], w, scales, biases, 32, 4)
    assert y1.shape == (40,)
    assert np.array_equal(as_numpy(y1), as_numpy(flat[8]))


def test_non_contiguous_inputs_give_the_contiguous_result() -> None:
    w, scales, biases = quantized(48, 256, 64, 8, mx.float32, seed=3)
    xt = mx.random.normal((256, 6), key=mx.random.key(4)).T  # a transposed view
    got = ops.quantized_matmul(xt, w, scales, biases, 64, 8)
    want = ops.quantized_matmul(mx.array(np.ascontiguousarray(as_numpy(xt))), w, scales, biases, 64, 8)
    assert np.array_equal(as_numpy(got), as_numpy(want))


@pytest.mark.parametrize("view", ["slice", "broadcast"])
def test_strided_views_are_gathered_like_their_copies(view: str) -> None:
    w, scales, biases = quantized(40, 128, 32, 4, mx.float32, seed=18)
    base = mx.random.normal((2, 5, 128), key=mx.random.key(19))
    x = base[:, 1:4:2, :] if view == "slice" else mx.broadcast_to(base[1, 2], (3, 128))
    got = ops.quantized_matmul(x, w, scales, biases, 32, 4)
    want = ops.quantized_matmul(mx.array(np.ascontiguousarray(as_numpy(x))), w, scales, biases, 32, 4)
    assert got.shape == want.shape
    assert np.array_equal(as_numpy(got), as_numpy(want))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [2, 3, 4, 5, 7, 8, 9, 10, 11, 64, 512])  # 2-5: AVX2 streams along the columns; 9 and 10: one sub-tile; 11: two
def test_a_row_is_bitwise_identical_alone_and_in_any_batch(m: int, bits: int) -> None:
    w, scales, biases = quantized(200, 576, 32, bits, mx.float16, seed=5)
    batch = rows(m, 576, seed=6)
    together = as_numpy(ops.quantized_matmul(batch, w, scales, biases, 32, bits))
    for i in sorted({0, m // 2, m - 1}):
        alone = as_numpy(ops.quantized_matmul(batch[i : i + 1], w, scales, biases, 32, bits))
        assert np.array_equal(alone[0], together[i]), f"row {i} of {m}"


@pytest.mark.usefixtures("restore_threads_and_isa")
@pytest.mark.parametrize("m", [1, 9, 17])  # each thread permutes x for itself up to 16 rows, the caller for all above
def test_thread_count_does_not_change_a_bit(m: int) -> None:
    w, scales, biases = quantized(1000, 576, 32, 4, mx.float16, seed=7)
    x = rows(m, 576, seed=8)
    outputs = []
    for threads in (1, 2, 3):
        ops.set_num_threads(threads)
        assert ops.num_threads() == threads
        outputs.append(as_numpy(ops.quantized_matmul(x, w, scales, biases, 32, 4)))
    assert all(np.array_equal(outputs[0], other) for other in outputs[1:])


@pytest.mark.usefixtures("restore_threads_and_isa")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 8, 17, 70])  # one row, a sub-tile, past the few-rows path, two row blocks
def test_products_of_one_input_run_together_with_the_bits_of_each_alone(bits: int, m: int) -> None:
    # A layer's q, k and v (and an odd width, so chunks straddle products and end mid-slice).
    layers = [quantized(n, 576, 32, bits, mx.float16, seed=20 + i) for i, n in enumerate((576, 192, 192, 40))]
    ws, scales, biases = ([layer[i] for layer in layers] for i in range(3))
    x = rows(m, 576, seed=30)
    alone = [as_numpy(ops.quantized_matmul(x, *layer, 32, bits)) for layer in layers]
    for threads in (1, 2, 3):
        ops.set_num_threads(threads)
        together = ops.quantized_matmuls(x, ws, scales, biases, 32, bits)
        assert [y.shape for y in together] == [(m, 576), (m, 192), (m, 192), (m, 40)]
        assert all(np.array_equal(as_numpy(y), want) for y, want in zip(together, alone, strict=True))
    strided = mx.broadcast_to(x[0], (3, 576))  # gathered once for all products
    together = ops.quantized_matmuls(strided, ws, scales, biases, 32, bits)
    assert all(np.array_equal(as_numpy(y), want[:1].repeat(3, axis=0)) for y, want in zip(together, alone, strict=True))


def test_products_of_one_input_must_agree_on_features_and_scale_type() -> None:
    a, b = quantized(16, 128, 32, 4, mx.float32, seed=21), quantized(16, 128, 32, 4, mx.float16, seed=22)
    x = rows(2, 128, seed=23)
    with pytest.raises(ValueError, match="same dtype"):
        ops.quantized_matmuls(x, [a[0], b[0]], [a[1], b[1]], [a[2], b[2]], 32, 4)
    wide = quantized(16, 256, 32, 4, mx.float32, seed=24)
    with pytest.raises(ValueError, match="features"):
        ops.quantized_matmuls(x, [a[0], wide[0]], [a[1], wide[1]], [a[2], wide[2]], 32, 4)
    with pytest.raises(ValueError, match="one or more weights"):
        ops.quantized_matmuls(x, [], [], [], 32, 4)


def supported_isas() -> list[str]:
    """The instruction sets this CPU runs, best first; leaves the last one selected."""
    isas = []
    for isa in ("avx512", "avx2", "generic"):
        try:
            ops.set_isa(isa)
        except ValueError:
            continue  # this CPU lacks it
        isas.append(isa)
    return isas


@pytest.mark.usefixtures("restore_threads_and_isa")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 9, 11, 16, 17])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16])
def test_every_instruction_set_gives_the_same_bits(bits: int, m: int, group_size: int, scale_dtype: mx.Dtype) -> None:
    # 70 columns: whole tiles and a tail; m == 1 takes the GEMV paths, 2..16 rows the row tiles
    # (AVX-512 4-bit: both with a table; AVX2 and generic: up to 8 rows), 17 the dequantized panel.
    w, scales, biases = quantized(70, 384, group_size, bits, scale_dtype, seed=9)
    x = rows(m, 384, seed=10)
    outputs = {}
    for isa in supported_isas():
        ops.set_isa(isa)
        outputs[isa] = as_numpy(ops.quantized_matmul(x, w, scales, biases, group_size, bits))
    assert "generic" in outputs and len(outputs) >= 2
    first = next(iter(outputs.values()))
    assert all(np.array_equal(first, other) for other in outputs.values())


@pytest.mark.usefixtures("restore_threads_and_isa")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [5, 8, 9, 16, 17])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16])
def test_a_row_is_its_one_row_product_bitwise_in_every_row_tile(bits: int, m: int, group_size: int, scale_dtype: mx.Dtype) -> None:
    # A batched step or a speculative round of 5..16 rows (4-bit layers, the embedded model's 8-bit
    # tied lm_head) takes one pass of row sub-tiles of up to 8 rows; 17 the panel. 75 columns:
    # 16-column tiles, then 4- and 2-column tiles and single columns. Every row of every tile must
    # be its one-row GEMV's bits.
    w, scales, biases = quantized(75, 384, group_size, bits, scale_dtype, seed=20)
    batch = rows(m, 384, seed=21)
    for isa in supported_isas():
        ops.set_isa(isa)
        together = as_numpy(ops.quantized_matmul(batch, w, scales, biases, group_size, bits))
        alone = [as_numpy(ops.quantized_matmul(batch[i : i + 1], w, scales, biases, group_size, bits))[0] for i in range(m)]
        for i in range(m):
            assert np.array_equal(together[i], alone[i]), f"{isa}: row {i} of {m}"


@pytest.mark.usefixtures("restore_threads_and_isa")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 6, 8, 16, 19])
def test_a_long_k_gives_every_row_its_one_row_bits_in_every_instruction_set(bits: int, m: int) -> None:
    # K = 1536 (the embedded model's down projection): AVX2 splits 8 rows into two sub-tiles there
    # (x outgrows L1) and its panel kernel walks a K that long; every row must still be its one-row
    # product's bits, and every instruction set the portable path's.
    w, scales, biases = quantized(40, 1536, 32, bits, mx.float16, seed=30)
    batch = rows(m, 1536, seed=31)
    outputs = {}
    for isa in supported_isas():
        ops.set_isa(isa)
        together = as_numpy(ops.quantized_matmul(batch, w, scales, biases, 32, bits))
        for i in range(m):
            alone = as_numpy(ops.quantized_matmul(batch[i : i + 1], w, scales, biases, 32, bits))[0]
            assert np.array_equal(together[i], alone), f"{isa}: row {i} of {m}"
        outputs[isa] = together
    generic = outputs["generic"]
    assert all(np.array_equal(generic, other) for other in outputs.values())


def test_compiled_call_matches_the_eager_one_bitwise() -> None:
    w, scales, biases = quantized(64, 256, 64, 4, mx.float16, seed=11)
    x = rows(3, 256, seed=12)

    def step(inp: mx.array) -> mx.array:
        return mx.tanh(ops.quantized_matmul(inp, w, scales, biases, 64, 4)) * 2.0

    assert np.array_equal(as_numpy(mx.compile(step)(x)), as_numpy(step(x)))


@pytest.mark.parametrize(
    ("change", "message"),
    [("bits", "bits must be 4 or 8"), ("group", "group_size must be"), ("dtype", "x must be float32"),
     ("features", "features"), ("partial_group", "multiple of group_size")],
)
def test_bad_arguments_are_value_errors(change: str, message: str) -> None:
    w, scales, biases = quantized(16, 128, 32, 4, mx.float32, seed=13)
    x = rows(2, 128, seed=14)
    bits, group = 4, 32
    if change == "bits":
        bits = 3
    elif change == "group":
        group = 16
    elif change == "dtype":
        x = x.astype(mx.float16)
    elif change == "partial_group":  # 40 features: the last group of 32 would be read past its end
        w, scales, biases = mx.zeros((16, 10), dtype=mx.uint32), mx.zeros((16, 1)), mx.zeros((16, 1))
        x, bits = rows(2, 40, seed=15), 8
    else:
        x = rows(2, 96, seed=15)
    with pytest.raises(ValueError, match=message):
        ops.quantized_matmul(x, w, scales, biases, group, bits)


def test_float_matmul_goes_to_the_shim_and_stays_correct() -> None:
    assert blas_status().name == "mlxkv-sgemm", blas_status().describe()
    rng = np.random.default_rng(16)
    a = rng.standard_normal((37, 300), dtype=np.float32)
    b = rng.standard_normal((300, 45), dtype=np.float32)
    got = as_numpy(mx.matmul(mx.array(a), mx.array(b)))
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=0, atol=1e-4)
    got_t = as_numpy(mx.matmul(mx.array(a), mx.array(b.T).T))  # a transposed operand
    np.testing.assert_allclose(got_t, got, rtol=0, atol=1e-5)


@pytest.mark.parametrize("k", [300, 64])  # 64: operands read in place, as attention's q.k^T
def test_float_matmul_row_is_bitwise_identical_alone_in_a_batch_and_with_b_transposed(k: int) -> None:
    rng = np.random.default_rng(17)
    a = mx.array(rng.standard_normal((9, k), dtype=np.float32))
    b_np = rng.standard_normal((k, 45), dtype=np.float32)
    b = mx.array(b_np)
    b_as_transposed = mx.array(np.ascontiguousarray(b_np.T)).T  # same values, the other layout
    batch = as_numpy(mx.matmul(a, b))
    for i in (0, 4, 8):
        assert np.array_equal(as_numpy(mx.matmul(a[i : i + 1], b))[0], batch[i])
        assert np.array_equal(as_numpy(mx.matmul(a[i : i + 1], b_as_transposed))[0], batch[i])
    assert np.array_equal(as_numpy(mx.matmul(a[2:5], b)), batch[2:5])


@pytest.mark.parametrize(("m", "k", "n", "b_transposed"), [
    (9, 512, 300, False), (9, 512, 300, True), (3, 700, 256, False), (1, 512, 700, True), (64, 96, 50, False),
])
def test_float_matmul_split_over_the_kernels_threads_gives_the_bits_of_one_thread(m: int, k: int, n: int,
                                                                                  b_transposed: bool) -> None:
    rng = np.random.default_rng(18)
    a = mx.array(rng.standard_normal((4, m, k), dtype=np.float32))  # a batch, as attention's heads
    b_np = rng.standard_normal((k, n), dtype=np.float32)
    b = mx.array(np.ascontiguousarray(b_np.T)).T if b_transposed else mx.array(b_np)
    previous = split_blas_products(False)
    try:
        alone = as_numpy(mx.matmul(a, b))
        assert split_blas_products(True) is False
        split = as_numpy(mx.matmul(a, b))
    finally:
        split_blas_products(previous)
    assert previous  # on by default
    assert np.array_equal(alone, split)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_project_gives_each_layers_own_output_with_biases_and_falls_back_for_other_layers(dtype: mx.Dtype) -> None:
    import mlx.nn as nn

    from mlxkv_inference.native.kernels import NativeQuantizedLinear, project, use_native_kernels

    # q, k and v with biases (qwen2's), then a layer the native kernel does not serve.
    model = nn.Sequential(*(nn.QuantizedLinear.from_linear(nn.Linear(128, n, bias=True), group_size=32, bits=4)  # type: ignore[no-untyped-call]
                            for n in (96, 32, 32)))
    biased = tree_map(lambda a: a + 0.25 if a.dtype == mx.float32 and a.ndim == 1 else a, model.parameters())  # type: ignore[no-untyped-call]
    model.update(biased)
    assert use_native_kernels(model) == 3
    layers = list(model.layers)
    assert all(isinstance(layer, NativeQuantizedLinear) for layer in layers)
    x = rows(5, 128, seed=31).astype(dtype)
    grouped = project(x, layers)
    for y, layer in zip(grouped, layers, strict=True):
        alone = layer(x)
        assert y.dtype == alone.dtype and np.array_equal(as_numpy(y), as_numpy(alone))
    dense = nn.Linear(128, 16)
    mixed = project(x.astype(mx.float32), [layers[0], dense])  # not all native: one call each
    assert np.array_equal(as_numpy(mixed[1]), as_numpy(dense(x.astype(mx.float32))))
    assert np.array_equal(as_numpy(mixed[0]), as_numpy(layers[0](x.astype(mx.float32))))
    assert project(x, []) == []
