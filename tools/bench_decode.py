"""Decode tokens/s: compiled step, uncompiled graph and mlx-lm's `stream_generate`, in one run.

Same model object (the embedded SmolLM2 unless --model), same prompt ids, EOS ignored; runs
alternate and the medians are compared. Then one decode step is taken apart: the tied lm_head,
the 30 layers, and the Python graph-building time, to show where the step's time goes.
`--cpu-kernels native`: the native kernels, and a second copy of the model whose layers run as
separate nodes (native/layer.py undone: the same tokens) as one more mode, where a layer runs as one.
Besides wall-clock tok/s each mode reports tok/s of this process's CPU time, steadier than the
wall clock on a machine shared with other work. `--model gemma3-270m`: the `gemma3` group's model
(sliding window 512: `--prompt-tokens 600` decodes with every ring wrapped).
Run: `uv run python -m tools.bench_decode [--cpu-kernels native] [--model gemma3-270m]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, load_binding  # first: the BLAS shim precedes mlx

import mlx.core as mx  # noqa: E402, I001
from mlxkv.paths import default_cache_dir
from mlxkv_inference._mlx_lm import mlx_lm_stream_responses, wrap_tokenizer
from mlxkv_inference.models.gemma3_270m import gemma3_270m_path
from mlxkv_inference.native.kernels import CPU_KERNELS
from mlxkv_inference.native.layer import separate_layers
from mlxkv_inference.tokenizer.gguf_tokenizer import GgufTokenizer
from tools.bench_generate import cpu_model, time_stream


def decode_tps(binding: MlxAutoregressiveBinding, prompt: list[int], n: int, mode: str,
               separate: MlxAutoregressiveBinding | None = None) -> tuple[float, float]:
    """(wall-clock, CPU-time) decode tok/s of one run in `mode`."""
    if mode == "separate layers":
        assert separate is not None
        return decode_tps(separate, prompt, n, "compiled")
    cpu = CpuClock()
    if mode == "mlx-lm":
        tokenizer = binding.tokenizer
        assert isinstance(tokenizer, GgufTokenizer)
        wrapper = wrap_tokenizer(tokenizer.backend, eos_token_ids=[])
        tokens = cpu.stream(mlx_lm_stream_responses(binding.model, wrapper, prompt, n))
    else:
        params = GenerationParams(max_tokens=n, ignore_eos=True, compiled_decode=mode == "compiled")
        tokens = cpu.stream(Generation(binding, prompt, params))
    return time_stream(len(prompt), tokens).decode_tps, cpu.decode_tps()


class CpuClock:
    """Process CPU time from the first streamed token to the last (the decode steps')."""

    def __init__(self) -> None:
        self.first = self.last = 0.0
        self.count = 0

    def stream(self, items: Iterable[object]) -> Iterator[object]:
        for item in items:
            self.last = time.process_time()
            if self.count == 0:
                self.first = self.last
            self.count += 1
            yield item

    def decode_tps(self) -> float:
        return (self.count - 1) / max(self.last - self.first, 1e-9)


def median_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def step_breakdown(binding: MlxAutoregressiveBinding, prompt: list[int]) -> None:
    """Where one uncompiled decode step's time goes (medians over 20 steps at this context)."""
    caches = binding.make_cache()
    binding.prefill(prompt, caches)
    model: object = binding.model
    inner = getattr(model, "model")
    token = mx.array([prompt[-1]])
    hidden = mx.random.normal((1, 1, binding.config["hidden_size"]))

    def full_step() -> None:
        mx.eval(binding.decode(token, caches))
        for c in caches:
            c.trim(1)

    def build_only() -> None:
        binding.decode(token, caches)
        for c in caches:
            c.trim(1)

    def lm_head() -> None:
        mx.eval(inner.embed_tokens.as_linear(hidden))

    step, head, graph = median_ms(full_step), median_ms(lm_head), median_ms(build_only)
    layers = len(inner.layers)
    print(f"step breakdown at {len(prompt)} tokens of context (uncompiled, medians):")
    print(f"  whole step      {step:7.2f} ms")
    print(f"  tied lm_head    {head:7.2f} ms  ({100 * head / step:4.1f}%)")
    print(f"  {layers} layers + embed + norm {step - head:7.2f} ms  ({100 * (step - head) / step:4.1f}%), {(step - head) / layers:.2f} ms a layer")
    print(f"  python graph building (no eval) {graph:6.2f} ms  ({100 * graph / step:4.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-kernels", choices=CPU_KERNELS, default="mlx",
                        help="mlx (default) or native: then also the native layers as separate nodes")
    parser.add_argument("--no-mlx-lm", dest="mlx_lm", action="store_false", help="leave mlx-lm's own loop out")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="leave the step breakdown out")
    args = parser.parse_args()
    if args.model == "gemma3-270m":
        args.model = gemma3_270m_path(default_cache_dir())
    print(f"cpu {cpu_model()}, {os.cpu_count()} cores; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    binding = load_binding(args.model, cpu_kernels=args.cpu_kernels)
    separate = None
    modes = ["compiled", "uncompiled"] + (["mlx-lm"] if args.mlx_lm else [])
    if args.cpu_kernels == "native":
        separate = load_binding(args.model, cpu_kernels="native")
        if separate_layers(separate.model):
            modes.insert(1, "separate layers")
        else:
            separate = None
            print("no layer of this model runs as one native node: no 'separate layers' mode")
    words = "The history of the lighthouse "
    prompt = binding.tokenizer.encode(words * (1 + args.prompt_tokens // 4))[: args.prompt_tokens]
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    decode_tps(binding, prompt[:8], 4, "compiled")  # warm-up: trace and JIT
    if separate is not None:
        decode_tps(separate, prompt[:8], 4, "compiled")
    for _ in range(args.repeats):
        for mode in modes:
            results[mode].append(decode_tps(binding, prompt, args.gen_tokens, mode, separate))
    report(binding, prompt, args, results)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.breakdown:
        step_breakdown(binding, prompt)


def report(binding: MlxAutoregressiveBinding, prompt: list[int], args: argparse.Namespace,
           results: dict[str, list[tuple[float, float]]]) -> None:
    wall = {m: statistics.median(w for w, _ in v) for m, v in results.items()}
    cpu = {m: statistics.median(c for _, c in v) for m, v in results.items()}
    print(f"model {binding.model_id}: {len(prompt)}-token prompt, {args.gen_tokens} decode steps, {args.repeats} runs each (median)")
    for mode, runs in results.items():
        print(f"  {mode:15s} {wall[mode]:7.2f} tok/s ({cpu[mode]:7.2f} per CPU second)   runs: "
              f"{', '.join(f'{w:.2f}' for w, _ in runs)}")

    def ratio(a: str, b: str) -> str:
        paired = ", ".join(f"{x[0] / y[0]:.3f}" for x, y in zip(results[a], results[b]))
        return f"{wall[a] / wall[b]:.3f}x (CPU time {cpu[a] / cpu[b]:.3f}x; each run: {paired})"

    if "mlx-lm" in results:
        print(f"  uncompiled / mlx-lm   {ratio('uncompiled', 'mlx-lm')}")
    print(f"  compiled / uncompiled {ratio('compiled', 'uncompiled')}")
    if "separate layers" in results:
        print(f"  compiled / separate layers {ratio('compiled', 'separate layers')}")


if __name__ == "__main__":
    main()
