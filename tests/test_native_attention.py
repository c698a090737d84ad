"""The native attention kernel (mlxkv-cpu-kernels `attend`): agreement with MLX's attention, a
row's output independent of everything but its query and its keys, and buffer semantics.

Model-free random tensors here; the models' use of it is pinned in test_batching.py and
test_speculative.py (native tiny models) and test_native_kernels_embedded.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest

import mlxkv_inference  # noqa: F401  (loads the BLAS shim before mlx, as the app does)

if sys.platform != "linux":
    pytest.skip("mlxkv-cpu-kernels is a Linux-only package", allow_module_level=True)

import mlx.core as mx
from mlxkv_cpu_kernels import ops


def attend(q: mx.array, k: mx.array, v: mx.array, positions: list[int], buffers: list[mx.array],
           rows: list[int]) -> tuple[mx.array, list[mx.array]]:
    out, *written = ops.attend(q, k, v, mx.array(positions, dtype=mx.int32), buffers, rows,
                               q.shape[-1] ** -0.5)
    return out, written


def tensors(rows: int, heads: int, kv_heads: int, dim: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    keys = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((rows, heads, dim), key=keys[0]), mx.random.normal((rows, kv_heads, dim), key=keys[1]),
            mx.random.normal((rows, kv_heads, dim), key=keys[2]))


def empty(kv_heads: int, dim: int, capacity: int = 64) -> list[mx.array]:
    return [mx.zeros((1, kv_heads, capacity, dim)), mx.zeros((1, kv_heads, capacity, dim))]


def heads_first(a: mx.array) -> mx.array:
    """(R, H, D) rows as MLX's (1, H, R, D)."""
    return a.transpose(1, 0, 2)[None]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 16), (9, 3, 64), (8, 2, 128)])
def test_matches_mlx_causal_attention_and_writes_the_rows(heads: int, kv_heads: int, dim: int) -> None:
    # 7 positions already in the buffers, 13 new ones attending causally from position 7.
    old_q, old_k, old_v = tensors(7, heads, kv_heads, dim, seed=1)
    q, k, v = tensors(13, heads, kv_heads, dim, seed=2)
    _, buffers = attend(old_q, old_k, old_v, [0], empty(kv_heads, dim), [7])
    out, written = attend(q, k, v, [7], buffers, [13])
    all_k, all_v = mx.concatenate([old_k, k]), mx.concatenate([old_v, v])
    want = mx.fast.scaled_dot_product_attention(heads_first(q), heads_first(all_k), heads_first(all_v),
                                                scale=dim ** -0.5, mask="causal")
    assert out.shape == (13, heads, dim)
    assert mx.allclose(heads_first(out), want, atol=1e-5, rtol=1e-5).item()
    assert mx.array_equal(written[0][0, :, :20], heads_first(all_k)[0]).item()
    assert mx.array_equal(written[1][0, :, :20], heads_first(all_v)[0]).item()
    assert (written[0][0, :, 20:] == 0).all().item()


# (6, 2, 32) over 40 positions; the embedded model's heads over 150, past the kernel's blocks of
# 64 keys and 8 rows (a block's rows attend different numbers of keys).
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "n"), [(6, 2, 32, 40), (9, 3, 64, 150)])
def test_a_row_is_bitwise_the_same_fed_alone_in_a_chunk_or_next_to_other_sequences(
        heads: int, kv_heads: int, dim: int, n: int) -> None:
    q, k, v = tensors(n, heads, kv_heads, dim, seed=3)
    together, _ = attend(q, k, v, [0], empty(kv_heads, dim, 256), [n])
    buffers, alone = empty(kv_heads, dim, 256), []
    for r in range(n):
        out, buffers = attend(q[r : r + 1], k[r : r + 1], v[r : r + 1], [r], buffers, [1])
        alone.append(out)
    assert mx.array_equal(mx.concatenate(alone), together).item()
    # Chunks of 5 and the rest, the second next to another sequence's 3 rows at another position.
    first, buffers = attend(q[:5], k[:5], v[:5], [0], empty(kv_heads, dim, 256), [5])
    oq, ok, ov = tensors(3, heads, kv_heads, dim, seed=4)
    _, other = attend(oq, ok, ov, [0], empty(kv_heads, dim), [3])
    second, _ = attend(mx.concatenate([oq, q[5:]]), mx.concatenate([ok, k[5:]]), mx.concatenate([ov, v[5:]]),
                       [3, 5], other + buffers, [3, n - 5])
    assert mx.array_equal(mx.concatenate([first, second[3:]]), together).item()


def test_rows_of_heads_go_in_flat_as_projections_give_them_with_the_same_bits() -> None:
    # A projection gives (..., H * D) rows: the kernel reads them as they lie, no per-head view.
    heads, kv_heads, dim = 9, 3, 64
    q, k, v = tensors(6, heads, kv_heads, dim, seed=12)
    positions = mx.array([0, 0], dtype=mx.int32)

    def run(shape: Callable[[mx.array], mx.array]) -> list[mx.array]:
        buffers = empty(kv_heads, dim) + empty(kv_heads, dim)
        return ops.attend(shape(q), shape(k), shape(v), positions, buffers, [2, 4], 0.125)

    per_head = run(lambda a: a)
    for shape, out_shape in (((lambda a: a.reshape(6, -1)), (6, heads * dim)),
                             ((lambda a: a.reshape(6, 1, -1)), (6, 1, heads * dim)),
                             ((lambda a: a.reshape(1, 6, -1)), (1, 6, heads * dim))):
        out, *written = run(shape)
        assert out.shape == out_shape
        assert mx.array_equal(out.reshape(per_head[0].shape), per_head[0]).item()
        assert all(mx.array_equal(a, b).item() for a, b in zip(written, per_head[1:], strict=True))
    with pytest.raises(ValueError, match="q must be"):  # heads and rows swapped: not rows of heads
        ops.attend(q.transpose(1, 0, 2), k, v, positions, empty(kv_heads, dim) * 2, [2, 4], 0.125)


# Query heads per kv head 3, 4, 5, 6 and 2 at head sizes 16..256: every block of heads the kernel
# scores together (4 at once up to 32 dims, 3 up to 64, then 1) and their remainders.
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(9, 3, 64), (9, 3, 128), (9, 3, 256), (8, 2, 32), (10, 2, 16), (12, 2, 64), (4, 2, 48)])
def test_every_instruction_set_and_thread_count_gives_the_same_bits(
        heads: int, kv_heads: int, dim: int, every_isa_and_thread_count: Callable[[], Iterator[tuple[str, int]]]) -> None:
    q, k, v = tensors(300, heads, kv_heads, dim, seed=5)  # enough work to split over threads; 300: a tail of keys
    reference, _ = attend(q, k, v, [0], empty(kv_heads, dim, 512), [300])
    for setting in every_isa_and_thread_count():
        assert mx.array_equal(attend(q, k, v, [0], empty(kv_heads, dim, 512), [300])[0], reference).item(), setting


def test_a_buffer_someone_still_holds_is_copied_not_overwritten() -> None:
    q, k, v = tensors(2, 4, 2, 16, seed=6)
    buffers = empty(2, 16)
    mx.eval(buffers)
    held = buffers[0]
    _, written = attend(q, k, v, [0], buffers, [2])
    mx.eval(written)
    assert (held == 0).all().item()
    assert mx.array_equal(written[0][0, :, :2], heads_first(k)[0]).item()


def test_compiled_call_matches_the_eager_one_with_the_position_as_an_input() -> None:
    q, k, v = tensors(1, 4, 2, 16, seed=7)
    _, buffers = attend(*tensors(9, 4, 2, 16, seed=8), [0], empty(2, 16), [9])

    def step(q: mx.array, k: mx.array, v: mx.array, position: mx.array, keys: mx.array, values: mx.array) -> list[mx.array]:
        return ops.attend(q, k, v, position, [keys, values], [1], 0.25)

    eager = step(q, k, v, mx.array([9], dtype=mx.int32), *buffers)
    compiled = mx.compile(step)(q, k, v, mx.array([9], dtype=mx.int32), *buffers)
    assert all(mx.array_equal(a, b).item() for a, b in zip(eager, compiled))


def test_positions_and_inv_freq_read_right_through_a_broadcast_or_strided_view() -> None:
    q, k, v = tensors(2, 4, 2, 16, seed=10)
    inv_freq = 1.0 / (10000 ** (mx.arange(0, 16, 2, dtype=mx.float32) / 16))
    dense = ops.attend(q, k, v, mx.array([5, 5], dtype=mx.int32), [*empty(2, 16), *empty(2, 16)], [1, 1], 0.25,
                       inv_freq=inv_freq, rope_dims=16)
    views = ops.attend(q, k, v, mx.broadcast_to(mx.array([5], dtype=mx.int32), (2,)), [*empty(2, 16), *empty(2, 16)],
                       [1, 1], 0.25, inv_freq=mx.repeat(inv_freq, 2)[::2], rope_dims=16)
    assert all(mx.array_equal(a, b).item() for a, b in zip(dense, views, strict=True))


@pytest.mark.parametrize(("change", "message"), [
    ("dtype", "float32"),
    ("heads", "multiple of kv heads"),
    ("dim", "multiple of 16"),
    ("rows", "add up"),
    ("positions", "int32"),
    ("buffers", "keys and a values buffer"),
    ("buffer_shape", "(1, Hkv, capacity, D)"),
    ("no_kv_heads", "(1, Hkv, capacity, D)"),
    ("no_query_heads", "multiple of kv heads"),
    ("inv_freq", "inv_freq"),
    ("no_capacity", "capacity > 0"),
    ("capacities", "one capacity"),
])
def test_bad_arguments_are_value_errors(change: str, message: str) -> None:
    q, k, v = tensors(3, 4, 2, 16, seed=9)
    positions, buffers, rows = mx.array([0], dtype=mx.int32), empty(2, 16), [3]
    inv_freq, rope_dims = None, 0
    if change == "dtype":
        q = q.astype(mx.float16)
    elif change == "heads":
        q = mx.zeros((3, 3, 16))
    elif change == "dim":
        q, k, v, buffers = mx.zeros((3, 4, 8)), mx.zeros((3, 2, 8)), mx.zeros((3, 2, 8)), empty(2, 8)
    elif change == "rows":
        rows = [2]
    elif change == "positions":
        positions = mx.array([0.0])
    elif change == "buffers":
        buffers = buffers[:1]
    elif change == "inv_freq":
        inv_freq, rope_dims = mx.ones((4,)), 16
    elif change == "no_kv_heads":
        k, v, buffers = mx.zeros((3, 0, 16)), mx.zeros((3, 0, 16)), empty(0, 16)
    elif change == "no_query_heads":
        q = mx.zeros((3, 0, 16))
    elif change == "no_capacity":
        buffers = empty(2, 16, capacity=0)
    elif change == "capacities":  # values shorter than keys: written at the keys' positions
        buffers = [empty(2, 16)[0], empty(2, 16, capacity=1)[1]]
    else:
        buffers = [mx.zeros((1, 3, 64, 16)), mx.zeros((1, 3, 64, 16))]
    with pytest.raises(ValueError, match=message):
        ops.attend(q, k, v, positions, buffers, rows, 0.25, inv_freq=inv_freq, rope_dims=rope_dims)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [16, 32])
def test_rope_in_the_kernel_matches_mlx_rope_before_it(traditional: bool, dims: int) -> None:
    q, k, v = tensors(5, 4, 2, 32, seed=10)
    base, scale, at = 10000.0, 0.5, 37
    inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))

    def rotated(a: mx.array) -> mx.array:
        return mx.fast.rope(heads_first(a), dims, traditional=traditional, base=base, scale=scale, offset=at)[0].transpose(1, 0, 2)

    _, buffers = attend(*tensors(at, 4, 2, 32, seed=11), [0], empty(2, 32), [at])
    want, want_buffers = attend(rotated(q), rotated(k), v, [at], buffers, [5])
    got, *got_buffers = ops.attend(q, k, v, mx.array([at], dtype=mx.int32), buffers, [5], 32 ** -0.5,
                                   inv_freq=inv_freq, rope_dims=dims, rope_traditional=traditional, rope_scale=scale)
    assert mx.allclose(got, want, atol=1e-5).item()
    assert mx.allclose(got_buffers[0], want_buffers[0], atol=1e-5).item()


@pytest.mark.parametrize("which", ["nn.RoPE", "Llama3RoPE", "unknown"])
def test_kernel_rope_reads_mlx_and_mlx_lm_rope_modules(which: str) -> None:
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE

    from mlxkv_inference.native.attention import kernel_rope

    if which == "unknown":  # a variant the kernel does not model: MLX keeps rotating
        assert kernel_rope(SuScaledRoPE(32, max_position_embeddings=4096, original_max_position_embeddings=64,
                                        short_factor=1.0, long_factor=1.0)) is None
        return
    module = nn.RoPE(32, base=10000.0, scale=0.5) if which == "nn.RoPE" else Llama3RoPE(
        32, base=500000.0, scaling_config={"factor": 8.0, "original_max_position_embeddings": 64})
    rope = kernel_rope(module)
    assert rope is not None and kernel_rope(module) is rope  # cached on the module
    q, k, v = tensors(3, 4, 2, 32, seed=12)
    at = 100

    def rotated(a: mx.array) -> mx.array:
        out: mx.array = module(heads_first(a), offset=at)[0].transpose(1, 0, 2)
        return out

    _, buffers = attend(*tensors(at, 4, 2, 32, seed=13), [0], empty(2, 32, 128), [at])
    want, _ = attend(rotated(q), rotated(k), v, [at], buffers, [3])
    got, *_ = ops.attend(q, k, v, mx.array([at], dtype=mx.int32), buffers, [3], 32 ** -0.5, inv_freq=rope.inv_freq,
                         rope_dims=rope.dims, rope_traditional=rope.traditional, rope_scale=rope.scale)
    assert mx.allclose(got, want, atol=1e-5).item()
