"""LoRA deltas on the native path, so that an adapted layer stays one node.

The fused decoder layer adds each adapted row's delta inside its node (`ops.decoder_layer`'s
`low_ranks`), reducing (x @ a) @ b as the fixed-order BLAS shim reduces MLX's float matmuls: a
row gets the bits of MLX's `y + scale * ((x @ a) @ b)` (adapters/delta.py), whatever the other
rows. That holds only where MLX's matmuls run on the shim, so `native_deltas_exact` probes it once
per shape against those MLX ops; where it fails, adapted layers run MLX's ops on every path alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlxkv_inference.adapters.delta import RowDelta

__all__ = ["LayerDeltas", "layer_deltas", "native_deltas_exact"]

_PROBED_ROWS = 8
_exact: dict[tuple[int, int, int], bool] = {}  # (inputs, rank, outputs) -> native delta == MLX ops, bitwise

# What decoder_layer takes for its deltas: (a, b) pairs, each delta's product, scale and rows.
LayerDeltas = tuple[list[mx.array], list[int], list[float], list[list[int]]]


def layer_deltas(deltas: Sequence[tuple[int, Sequence[RowDelta]]]) -> LayerDeltas | None:
    """The fused layer's arguments for each (product index, its deltas); None where a delta's
    shape is not probed exact (the layer then runs as separate nodes, MLX's ops adding deltas)."""
    factors: list[mx.array] = []
    products: list[int] = []
    scales: list[float] = []
    rows: list[list[int]] = []
    for product, row_deltas in deltas:
        for delta in row_deltas:
            a_t, b = delta.lora_a_t, delta.lora_b
            if a_t.dtype != mx.float32 or not native_deltas_exact(int(a_t.shape[1]), int(a_t.shape[0]), int(b.shape[1])):
                return None
            factors += [a_t, b]
            products.append(product)
            scales.append(delta.scale)
            rows.append(delta.rows)
    return factors, products, scales, rows


def native_deltas_exact(inputs: int, rank: int, outputs: int) -> bool:
    """Whether the native delta of this shape gives, for 1..8 rows, bitwise what MLX's ops give
    (probed once per shape; False where the native kernels cannot run)."""
    shape = (inputs, rank, outputs)
    if shape not in _exact:
        try:
            _exact[shape] = _agrees(shape)
        except (ImportError, RuntimeError, ValueError):
            _exact[shape] = False
    return _exact[shape]


def _agrees(shape: tuple[int, int, int]) -> bool:
    from mlxkv_cpu_kernels import ops

    inputs, rank, outputs = shape
    keys = mx.random.split(mx.random.key(inputs * 131 + rank * 17 + outputs), 4)
    x = mx.random.normal((_PROBED_ROWS, 1, inputs), key=keys[0])
    y = mx.random.normal((_PROBED_ROWS, 1, outputs), key=keys[1])
    a = mx.random.normal((inputs, rank), key=keys[2]) * inputs**-0.5
    b = mx.random.normal((rank, outputs), key=keys[3])
    scale = 1.7
    for m in range(1, _PROBED_ROWS + 1):
        for xs, ys in ((x[:m], y[:m]), (x[:m].reshape(1, m, inputs), y[:m].reshape(1, m, outputs))):
            expected = ys + (scale * ((xs @ a) @ b)).astype(xs.dtype)  # adapters/delta.py's ops
            native = ops.low_rank(ys, xs, [a.T], [b], [scale], [list(range(m))])
            if not mx.array_equal(native, expected).item():
                return False
    return True
