"""LoRA deltas on the native path: `ops.low_rank` against the MLX ops it replaces (adapters/delta.py),
bit for bit, and an adapted decoder layer as one native node giving the bits of its separate nodes.

The oracle for the layer is the same binding with the fused node off (`_fused_parts` answering
None): the adapted linears then add their deltas with MLX's ops. Logits and the keys and values
written must agree in every forward the engine runs under adapters: chunked prefill, a decode
step, a round's rows and a batched step mixing adapted, stacked and base rows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.native import layer as native_layer
from mlxkv_inference.native import low_rank
from tests.adapter_factories import adapted_caches, write_random_adapter
from tests.factories import make_prompt, make_tiny_binding

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the native CPU kernels are Linux-only")


def mlx_delta(y: mx.array, x: mx.array, a: mx.array, b: mx.array, scale: float, rows: list[int]) -> mx.array:
    """AdaptedLinear's ops for the rows of (R, 1, D) `x` picked by `rows` (a mask, as a step's group)."""
    mask = mx.array([r in rows for r in range(x.shape[0])]).reshape(-1, 1, 1)
    return mx.where(mask, y + (scale * ((x @ a) @ b)).astype(x.dtype), y)


@pytest.mark.parametrize(("inputs", "ranks", "outputs"), [(96, (8, 4), 160), (100, (20, 3), 75)])
def test_low_rank_gives_picked_rows_the_bits_of_mlx_s_ops_in_order_and_leaves_the_others(
        inputs: int, ranks: tuple[int, int], outputs: int,
        every_isa_and_thread_count: Callable[[], Iterator[tuple[str, int]]]) -> None:
    from mlxkv_cpu_kernels import ops

    keys = mx.random.split(mx.random.key(inputs), 6)
    x, y = mx.random.normal((6, 1, inputs), key=keys[0]), mx.random.normal((6, 1, outputs), key=keys[1])
    a1, b1 = mx.random.normal((inputs, ranks[0]), key=keys[2]) * 0.1, mx.random.normal((ranks[0], outputs), key=keys[3])
    a2, b2 = mx.random.normal((inputs, ranks[1]), key=keys[4]) * 0.1, mx.random.normal((ranks[1], outputs), key=keys[5])
    # Row 3 runs under both (a stack: the first delta, then the second); rows 1 and 4 under none.
    expected = mlx_delta(mlx_delta(y, x, a1, b1, 20.0, [0, 2, 3]), x, a2, b2, 0.3, [3, 5])
    for setting in every_isa_and_thread_count():
        out = ops.low_rank(y, x, [a1.T, a2.T], [b1, b2], [20.0, 0.3], [[0, 2, 3], [3, 5]])
        assert mx.array_equal(out, expected).item(), setting
        assert mx.array_equal(out[mx.array([1, 4])], y[mx.array([1, 4])]).item()
        assert not mx.array_equal(out[0], y[0]).item()


def test_low_rank_refuses_factors_of_another_shape_and_rows_outside_the_input() -> None:
    from mlxkv_cpu_kernels import ops

    x, y = mx.zeros((4, 32)), mx.zeros((4, 48))
    with pytest.raises(ValueError, match=r"low_rank: low-rank a_t must be \(rank, 32\) and b \(rank, 48\)"):
        ops.low_rank(y, x, [mx.zeros((4, 48))], [mx.zeros((4, 48))], [1.0], [[0]])
    with pytest.raises(ValueError, match=r"low_rank: low-rank row 4 is outside 0..3"):
        ops.low_rank(y, x, [mx.zeros((4, 32))], [mx.zeros((4, 48))], [1.0], [[1, 4]])
    with pytest.raises(ValueError, match=r"give each low-rank delta its scale, its rows"):
        ops.low_rank(y, x, [mx.zeros((4, 32))], [mx.zeros((4, 48))], [1.0, 2.0], [[1]])


def adapted_forwards(binding: MlxAutoregressiveBinding, adapters: list[Path]) -> list[np.ndarray]:
    """Logits of a chunked prefill, a decode step and a 3-row round under an adapter, then a
    batched step over that sequence (1 row), a base sequence (3 rows) and one under a stack of
    both adapters (2 rows), and every cache's keys and values."""
    prompt = make_prompt(13, seed=5)
    first, base, stacked = (adapted_caches(binding, adapters[0]), binding.make_cache(),
                            adapted_caches(binding, adapters[0], adapters[1]))
    binding.prefill(prompt, first, chunk_size=5)
    out = [np.array(binding.decode(mx.array([7]), first)), np.array(binding.decode(mx.array([3, 1, 4]), first))]
    binding.prefill(prompt[:9], base)
    binding.prefill(prompt[:6], stacked, chunk_size=4)
    out.append(np.array(binding.decode_batch(mx.array([9, 2, 6, 5, 8, 1]), [first, base, stacked], lengths=[1, 3, 2])))
    for sequence in (first, base, stacked):
        for cache in sequence:
            assert isinstance(cache, PlainKVCache) and cache.keys is not None and cache.values is not None
            out += [np.array(cache.keys[..., : cache.offset, :]), np.array(cache.values[..., : cache.offset, :])]
    return out


def test_an_adapted_layer_in_one_native_node_gives_the_bits_of_its_separate_nodes(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mlxkv_cpu_kernels import ops

    binding = make_tiny_binding("llama", seed=4, native=True)
    adapters = [write_random_adapter(binding, tmp_path / "all", seed=1, rank=8),
                write_random_adapter(binding, tmp_path / "one", seed=2, rank=4, layers=[1], linears=("mlp.down_proj",))]
    calls: list[int] = []
    fused_layer = ops.decoder_layer

    def counted(*args: object, **kwargs: object) -> list[mx.array]:
        deltas = kwargs.get("low_ranks")
        calls.append(len(deltas) // 2 if isinstance(deltas, list) else 0)
        return fused_layer(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "decoder_layer", counted)
    fused = adapted_forwards(binding, adapters)
    # Deltas per fused call (2 layers): the first sequence's 3 chunks, step and round (7: q..down),
    # the base prefill (none), the stack's 2 chunks (layer 1 adds the second adapter's down), and
    # the batched step (two groups: the adapter alone and the stack).
    assert calls == [7] * 10 + [0, 0] + [7, 8] * 2 + [14, 15]
    monkeypatch.setattr(low_rank, "native_deltas_exact", lambda inputs, rank, outputs: False)
    calls.clear()
    probed_off = adapted_forwards(binding, adapters)
    assert calls == [0, 0]  # no delta probed exact: adapted layers run as separate nodes, the base fused
    monkeypatch.setattr(native_layer, "_fused_parts", lambda layer: None)
    separate = adapted_forwards(binding, adapters)
    assert len(fused) == len(separate) == len(probed_off)
    assert all(np.array_equal(f, s) for f, s in zip(fused, separate, strict=True))
    assert all(np.array_equal(f, s) for f, s in zip(fused, probed_off, strict=True))
