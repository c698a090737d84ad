"""Native quantized matmul vs `mx.quantized_matmul`, in one run, on the embedded model's shapes.

GEMV (1 row): weight GB/s (packed weights + scales + biases read once) against a measured
single-thread read bandwidth. 64 rows: GFLOP/s. Decode step: every product of one token (30 layers
x 7 linears + the tied lm_head, distinct weights as in the model, so they stream from memory) in
one eval. Ratios are mlx time / native time from the same run.
Run: `uv run python tools/bench_kernel.py [--threads 1 2] [--bits 4]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlxkv_cpu_kernels

mlxkv_cpu_kernels.load_blas()

import mlx.core as mx  # noqa: E402  (after the BLAS shim)
import numpy as np  # noqa: E402

from mlxkv_cpu_kernels import ops  # noqa: E402

# (name, N, K) of SmolLM2-135M's linears and its tied lm_head.
SHAPES = [("q/o_proj", 576, 576), ("k/v_proj", 192, 576), ("gate/up", 1536, 576),
          ("down", 576, 1536), ("lm_head", 49152, 576)]
# One decoder layer's linears in order: q, k, v, o, gate, up, down.
LAYER_SHAPES = [SHAPES[0], SHAPES[1], SHAPES[1], SHAPES[0], SHAPES[2], SHAPES[2], SHAPES[3]]


def median_s(fn: Callable[[], mx.array | list[mx.array]], repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth_gbs() -> float:
    """One-thread read bandwidth: numpy summing a 512 MiB array."""
    data = np.ones(64 * 2**20, dtype=np.float64)
    data.sum()
    start = time.perf_counter()
    data.sum()
    return data.nbytes / (time.perf_counter() - start) / 1e9


def bench_shape(name: str, n: int, k: int, bits: int, group_size: int, rows: int, repeats: int) -> None:
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=bits)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)  # as GGUF ships them
    x = mx.random.normal((rows, k))
    mx.eval(w, scales, biases, x)
    native = median_s(lambda: ops.quantized_matmul(x, w, scales, biases, group_size, bits), repeats)
    ref = median_s(lambda: mx.quantized_matmul(x, w, scales, biases, transpose=True,
                                               group_size=group_size, bits=bits), repeats)
    weight_bytes = w.nbytes + scales.nbytes + biases.nbytes
    if rows == 1:
        print(f"  {name:9s} {n:6d}x{k:<5d} native {weight_bytes / native / 1e9:6.2f} GB/s"
              f" ({native * 1e3:7.3f} ms)  mlx {weight_bytes / ref / 1e9:6.2f} GB/s"
              f" ({ref * 1e3:7.3f} ms)  x{ref / native:5.1f}")
    else:
        flops = 2 * rows * n * k
        print(f"  {name:9s} {n:6d}x{k:<5d} native {flops / native / 1e9:7.1f} GFLOP/s"
              f" ({native * 1e3:7.3f} ms)  mlx {flops / ref / 1e9:6.1f} GFLOP/s"
              f" ({ref * 1e3:7.3f} ms)  x{ref / native:5.1f}")


def bench_decode_step(bits: int, group_size: int, repeats: int) -> None:
    # float32 scales and biases: what the GGUF loader hands the kernel (it upcasts float16).
    layers = []
    for _ in range(30):
        for _name, n, k in LAYER_SHAPES:
            w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=bits)
            layers.append((w, scales, biases, k))
    head_n, head_k = SHAPES[-1][1], SHAPES[-1][2]
    w, scales, biases = mx.quantize(mx.random.normal((head_n, head_k)), group_size=group_size, bits=bits)
    layers.append((w, scales, biases, head_k))
    xs = {k: mx.random.normal((1, k)) for k in {576, 1536}}
    mx.eval(layers, xs)
    weight_bytes = sum(w.nbytes + s.nbytes + b.nbytes for w, s, b, _ in layers)

    def step(matmul: Callable[[mx.array, mx.array, mx.array, mx.array], mx.array]) -> Callable[[], list[mx.array]]:
        return lambda: [matmul(xs[k], w, s, b) for w, s, b, k in layers]

    native = median_s(step(lambda x, w, s, b: ops.quantized_matmul(x, w, s, b, group_size, bits)), repeats)
    ref = median_s(step(lambda x, w, s, b: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size,
                                                               bits=bits)), max(3, repeats // 5))
    print(f"  decode step ({len(layers)} products, {weight_bytes / 1e6:.0f} MB) native {native * 1e3:7.2f} ms"
          f" ({weight_bytes / native / 1e9:5.1f} GB/s)  mlx {ref * 1e3:7.2f} ms  x{ref / native:5.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, ops.num_threads()])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"isa {ops.isa()}, bits {args.bits}, group size {args.group_size}, "
          f"BLAS {mlxkv_cpu_kernels.blas_status().describe()}")
    print(f"read bandwidth, one thread (numpy sum): {read_bandwidth_gbs():.1f} GB/s")
    for threads in dict.fromkeys(args.threads):
        ops.set_num_threads(threads)
        for rows in (1, args.rows):
            print(f"threads {threads}, rows {rows}:")
            for name, n, k in SHAPES:
                bench_shape(name, n, k, args.bits, args.group_size, rows, args.repeats)
        bench_decode_step(args.bits, args.group_size, args.repeats)


if __name__ == "__main__":
    main()
