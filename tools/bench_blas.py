"""MLX's float32 attention through the BLAS shim with its products split over the native kernels'
threads and on one thread, alternating in one run, with the outputs checked bitwise equal.

The workload is what a Gemma 3 270M step or round attends where the native attention kernel does
not serve it: 18 layers of `scaled_dot_product_attention` for 4 query heads over 1 kv head of 256
dimensions, L query rows (1: a single step; 4 and 9: speculative rounds) over a 512-cell buffer
masked at 400 tokens, compiled. Each setting's time is the best of --repeats calls, per round of
settings; the printed figure is the median over --rounds.
Run: `uv run python -m tools.bench_blas [--rounds 4] [--repeats 15]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import mlxkv_inference  # noqa: F401  (first: the BLAS shim precedes mlx)
import mlxkv_cpu_kernels.ops  # noqa: F401  (hands the kernels' pool to the shim)

import mlx.core as mx  # noqa: E402, I001
from mlx_lm.models.base import scaled_dot_product_attention
from mlxkv_cpu_kernels import blas_status, split_blas_products
from tools.bench_generate import cpu_model

LAYERS, HEADS, DIM, CELLS, CONTEXT = 18, 4, 256, 512, 400


def best_ms(run: Callable[[], list[mx.array]], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(run())
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description="float attention with the BLAS shim's products split over threads and not")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of both settings (default: 4)")
    parser.add_argument("--repeats", type=int, default=15, help="calls per setting and round, best taken (default: 15)")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
    if blas_status().name != "mlxkv-sgemm":
        print(f"the shim is not serving MLX's matmuls here: {blas_status().describe()}", file=sys.stderr)
        return 1
    print(f"cpu {cpu_model()}, {os.cpu_count()} cores; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"BLAS {blas_status().describe()}")

    def attend(qs: list[mx.array], ks: list[mx.array], vs: list[mx.array], mask: mx.array) -> list[mx.array]:
        return [scaled_dot_product_attention(q, k, v, cache=None, scale=DIM**-0.5, mask=mask) for q, k, v in zip(qs, ks, vs)]

    compiled = mx.compile(attend)
    exact = True
    previous = split_blas_products(True)
    try:
        for rows in (1, 4, 9):
            qs = [mx.random.normal((1, HEADS, rows, DIM), key=mx.random.key(i)) for i in range(LAYERS)]
            ks = [mx.random.normal((1, 1, CELLS, DIM), key=mx.random.key(100 + i)) for i in range(LAYERS)]
            vs = [mx.random.normal((1, 1, CELLS, DIM), key=mx.random.key(200 + i)) for i in range(LAYERS)]
            mask = mx.arange(CELLS)[None] <= (CONTEXT + mx.arange(rows))[:, None]
            times: dict[bool, list[float]] = {False: [], True: []}
            outputs: dict[bool, list[mx.array]] = {}
            for _ in range(args.rounds):
                for split in (False, True):
                    split_blas_products(split)
                    times[split].append(best_ms(lambda: compiled(qs, ks, vs, mask), args.repeats))
                    outputs[split] = compiled(qs, ks, vs, mask)
                    mx.eval(outputs[split])
            exact = exact and all(bool(mx.array_equal(a, b).item()) for a, b in zip(outputs[False], outputs[True]))
            one, two = statistics.median(times[False]), statistics.median(times[True])
            print(f"  L={rows}: one thread {one:6.2f} ms, split {two:6.2f} ms ({one / two:.2f}x)")
    finally:
        split_blas_products(previous)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("outputs bitwise equal" if exact else "SPLIT CHANGED THE BITS")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
