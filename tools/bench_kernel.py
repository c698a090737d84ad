"""Native quantized matmul vs `mx.quantized_matmul`, in one run, on the embedded model's shapes.

GEMV (1 row): weight GB/s (packed weights + scales + biases read once) against a measured
single-thread read bandwidth. 64 rows: GFLOP/s. Decode step: every product of one token (30 layers
x 7 linears + the tied lm_head, distinct weights as in the model, so they stream from memory) in
one eval. Ratios are mlx time / native time from the same run.
Multi-row step (`--step-rows 4 5 8 9 16`): the native decode step with that many rows per product
(a continuous batch, or a speculative round's positions), run as the model runs it (a layer's q, k
and v in one call, gate and up in one), each row count's time as a ratio to the first count's, the
lm_head's share, and the same products one call each as a ratio to that; `--head-bits 8` as the
embedded GGUF ships its tied head.
Attention (`--attention-context 256 1024 4096`): one decode row of each of 1 and 8 sequences, and
8 rows of one sequence (a speculative round, a block of a prefill chunk), against that many
positions, 30 layers with their own float32 KV (so it streams from memory as in the model), one
eval a step: the native kernel vs MLX's `scaled_dot_product_attention` per
sequence (as mlx-lm runs it), and the KV bytes read per second.
Run: `uv run python -m tools.bench_kernel [--threads 1 2] [--bits 4] [--step-rows 4 5 8 9 16 --head-bits 8]
[--attention-context 256 1024 4096]`.
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


Layer = tuple[mx.array, mx.array, mx.array, int]


def step_weights(bits: int, head_bits: int, group_size: int) -> list[Layer]:
    """One token's distinct weights: 30 layers x 7 linears, then the tied lm_head (last)."""
    # float32 scales and biases: what the GGUF loader hands the kernel (it upcasts float16).
    layers = []
    for _ in range(30):
        for _name, n, k in LAYER_SHAPES:
            w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=bits)
            layers.append((w, scales, biases, k))
    head_n, head_k = SHAPES[-1][1], SHAPES[-1][2]
    w, scales, biases = mx.quantize(mx.random.normal((head_n, head_k)), group_size=group_size, bits=head_bits)
    layers.append((w, scales, biases, head_k))
    mx.eval(layers)
    return layers


def bench_decode_step(bits: int, head_bits: int, group_size: int, repeats: int) -> None:
    layers = step_weights(bits, head_bits, group_size)
    xs = {k: mx.random.normal((1, k)) for k in {576, 1536}}
    mx.eval(xs)
    weight_bytes = sum(w.nbytes + s.nbytes + b.nbytes for w, s, b, _ in layers)

    def step(matmul: Callable[[mx.array, mx.array, mx.array, mx.array], mx.array]) -> Callable[[], list[mx.array]]:
        return lambda: [matmul(xs[k], w, s, b) for w, s, b, k in layers]

    def bits_of(w: mx.array, k: int) -> int:
        return w.shape[1] * 32 // k

    native = median_s(step(lambda x, w, s, b: ops.quantized_matmul(x, w, s, b, group_size, bits_of(w, x.shape[1]))),
                      repeats)
    ref = median_s(step(lambda x, w, s, b: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size,
                                                               bits=bits_of(w, x.shape[1]))), max(3, repeats // 5))
    print(f"  decode step ({len(layers)} products, {weight_bytes / 1e6:.0f} MB) native {native * 1e3:7.2f} ms"
          f" ({weight_bytes / native / 1e9:5.1f} GB/s)  mlx {ref * 1e3:7.2f} ms  x{ref / native:5.1f}")


def bench_step_rows(step_rows: list[int], bits: int, head_bits: int, group_size: int, repeats: int) -> None:
    """The native step at each row count, as a ratio to the first count's, measured in interleaved
    rounds; run as the model runs it (each layer's q, k, v in one call, gate and up in one), and
    with one call per product, as a ratio."""
    layers = step_weights(bits, head_bits, group_size)
    xs = {(m, k): mx.random.normal((m, k)) for m in step_rows for k in (576, 1536)}
    mx.eval(xs)
    grouped: list[list[Layer]] = []  # the model's calls
    for i in range(0, len(layers) - 1, 7):
        q, k, v, o, gate, up, down = layers[i:i + 7]
        grouped += [[q, k, v], [o], [gate, up], [down]]
    grouped.append(layers[-1:])

    def products(m: int, calls: list[list[Layer]]) -> Callable[[], list[mx.array]]:
        def run() -> list[mx.array]:
            out: list[mx.array] = []
            for call in calls:
                k = call[0][3]
                out += ops.quantized_matmuls(xs[(m, k)], [w for w, _, _, _ in call], [s for _, s, _, _ in call],
                                             [b for _, _, b, _ in call], group_size, call[0][0].shape[1] * 32 // k)
            return out
        return run

    separate = [[layer] for layer in layers]
    step_s: dict[int, list[float]] = {m: [] for m in step_rows}
    apart_s: dict[int, list[float]] = {m: [] for m in step_rows}
    head_s: dict[int, list[float]] = {m: [] for m in step_rows}
    # Rounds over all counts, so drift on a shared machine hits every count alike.
    for _ in range(max(1, repeats // 3)):
        for m in step_rows:
            step_s[m].append(median_s(products(m, grouped), 3))
            apart_s[m].append(median_s(products(m, separate), 3))
            head_s[m].append(median_s(products(m, separate[-1:]), 3))
    # The fastest round: on a shared machine the one least disturbed by other processes.
    ref_step, ref_head = min(step_s[step_rows[0]]), min(head_s[step_rows[0]])
    for m in step_rows:
        st, apart, hd = min(step_s[m]), min(apart_s[m]), min(head_s[m])
        print(f"  step rows {m:3d}: {st * 1e3:7.2f} ms  x{st / ref_step:5.2f} of rows {step_rows[0]}"
              f"   lm_head {hd * 1e3:6.2f} ms  x{hd / ref_head:5.2f}   one call per product {apart * 1e3:7.2f} ms"
              f" x{apart / st:5.2f}")


# The embedded model's attention: query heads, kv heads, head size, layers.
ATTENTION = (9, 3, 64, 30)


def bench_attention(contexts: list[int], repeats: int) -> None:
    """Native attention vs MLX's, a step's 30 layers per eval: one decode row of each of 1 and 8
    sequences, and 8 rows of one sequence (a speculative round, a block of a prefill chunk)."""
    heads, kv_heads, dim, layers = ATTENTION
    for sequences, rows in ((1, 1), (8, 1), (1, 8)):
        for context in contexts:
            capacity = (context + 256) // 256 * 256  # the cache grows in 256-position steps
            kv = [[(mx.random.normal((1, kv_heads, capacity, dim)), mx.random.normal((1, kv_heads, capacity, dim)))
                   for _ in range(sequences)] for _ in range(layers)]
            q = mx.random.normal((sequences * rows, heads, dim))
            k = mx.random.normal((sequences * rows, kv_heads, dim))
            v = mx.random.normal((sequences * rows, kv_heads, dim))
            positions = mx.array([context - rows] * sequences, dtype=mx.int32)
            # each sequence's rows as MLX's (1, H, R, D), once, outside the timed reference
            queries = [q[i * rows:(i + 1) * rows].transpose(1, 0, 2)[None] for i in range(sequences)]
            mx.eval(kv, q, k, v, queries)

            def native() -> list[mx.array]:
                outs = []
                for layer in kv:
                    out, *written = ops.attend(q, k, v, positions, [b for pair in layer for b in pair],
                                               [rows] * sequences, dim**-0.5)
                    layer[:] = [(written[i], written[i + 1]) for i in range(0, len(written), 2)]
                    outs.append(out)
                return outs

            def reference() -> list[mx.array]:
                return [mx.fast.scaled_dot_product_attention(queries[i], pair[0][..., :context, :],
                                                             pair[1][..., :context, :], scale=dim**-0.5,
                                                             mask="causal" if rows > 1 else None)
                        for layer in kv for i, pair in enumerate(layer)]

            ref = median_s(reference, repeats)
            took = median_s(native, repeats)
            read = layers * sequences * 2 * kv_heads * context * dim * 4
            shape = f"{sequences} x {context:5d}" if rows == 1 else f"{rows} rows of 1 x {context:5d}"
            print(f"  attention {shape} positions: native {took * 1e3:7.2f} ms "
                  f"({read / took / 1e9:5.1f} GB/s of KV)  mlx {ref * 1e3:7.2f} ms  x{ref / took:5.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, ops.num_threads()])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--head-bits", type=int, default=None, help="lm_head bits in the decode step (default: --bits)")
    parser.add_argument("--step-rows", type=int, nargs="+", default=None,
                        help="only the native decode step at these row counts, as ratios to the first")
    parser.add_argument("--attention-context", type=int, nargs="+", default=None,
                        help="only attention, against these numbers of positions")
    args = parser.parse_args()
    head_bits = args.bits if args.head_bits is None else args.head_bits
    print(f"isa {ops.isa()}, bits {args.bits}, head bits {head_bits}, group size {args.group_size}, "
          f"BLAS {mlxkv_cpu_kernels.blas_status().describe()}")
    if args.attention_context:
        for threads in dict.fromkeys(args.threads):
            ops.set_num_threads(threads)
            print(f"threads {threads}:")
            bench_attention(args.attention_context, args.repeats)
        return
    if args.step_rows:
        for threads in dict.fromkeys(args.threads):
            ops.set_num_threads(threads)
            print(f"threads {threads}:")
            bench_step_rows(args.step_rows, args.bits, head_bits, args.group_size, args.repeats)
        return
    print(f"read bandwidth, one thread (numpy sum): {read_bandwidth_gbs():.1f} GB/s")
    for threads in dict.fromkeys(args.threads):
        ops.set_num_threads(threads)
        for rows in (1, args.rows):
            print(f"threads {threads}, rows {rows}:")
            for name, n, k in SHAPES:
                bench_shape(name, n, k, args.bits, args.group_size, rows, args.repeats)
        bench_decode_step(args.bits, head_bits, args.group_size, args.repeats)


if __name__ == "__main__":
    main()
