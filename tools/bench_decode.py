"""Decode tokens/s: compiled step, uncompiled graph and mlx-lm's `stream_generate`, in one run.

Same model object (the embedded SmolLM2 unless --model), same prompt ids, EOS ignored; runs
alternate and the medians are compared. Then one decode step is taken apart: the tied lm_head,
the 30 layers, and the Python graph-building time, to show where the step's time goes.
`--cpu-kernels native`: the native kernels, and a second copy of the model whose layers run as
separate nodes (native/layer.py undone: the same tokens) as one more mode.
Run: `uv run python -m tools.bench_decode [--cpu-kernels native]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, load_binding  # first: the BLAS shim precedes mlx

import mlx.core as mx  # noqa: E402, I001
from mlxkv_inference._mlx_lm import mlx_lm_stream_responses, wrap_tokenizer
from mlxkv_inference.native.kernels import CPU_KERNELS
from mlxkv_inference.native.layer import separate_layers
from mlxkv_inference.tokenizer.gguf_tokenizer import GgufTokenizer
from tools.bench_generate import time_stream


def decode_tps(binding: MlxAutoregressiveBinding, prompt: list[int], n: int, mode: str,
               separate: MlxAutoregressiveBinding | None = None) -> float:
    if mode == "separate layers":
        assert separate is not None
        return decode_tps(separate, prompt, n, "compiled")
    if mode == "mlx-lm":
        tokenizer = binding.tokenizer
        assert isinstance(tokenizer, GgufTokenizer)
        wrapper = wrap_tokenizer(tokenizer.backend, eos_token_ids=[])
        return time_stream(len(prompt), mlx_lm_stream_responses(binding.model, wrapper, prompt, n)).decode_tps
    params = GenerationParams(max_tokens=n, ignore_eos=True, compiled_decode=mode == "compiled")
    return time_stream(len(prompt), Generation(binding, prompt, params)).decode_tps


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
    args = parser.parse_args()
    binding = load_binding(args.model, cpu_kernels=args.cpu_kernels)
    separate = None
    modes = ["compiled", "uncompiled", "mlx-lm"]
    if args.cpu_kernels == "native":
        separate = load_binding(args.model, cpu_kernels="native")
        if not separate_layers(separate.model):
            parser.error("no layer of this model runs as one native node")
        modes.insert(1, "separate layers")
    prompt = binding.tokenizer.encode("The history of the lighthouse " * 40)[: args.prompt_tokens]
    results: dict[str, list[float]] = {m: [] for m in modes}
    decode_tps(binding, prompt[:8], 4, "compiled")  # warm-up: trace and JIT
    if separate is not None:
        decode_tps(separate, prompt[:8], 4, "compiled")
    for _ in range(args.repeats):
        for mode in modes:
            results[mode].append(decode_tps(binding, prompt, args.gen_tokens, mode, separate))
    med = {m: statistics.median(v) for m, v in results.items()}
    print(f"model {binding.model_id}: {len(prompt)}-token prompt, {args.gen_tokens} decode steps, {args.repeats} runs each (median)")
    for mode in modes:
        print(f"  {mode:15s} {med[mode]:7.2f} tok/s   runs: {', '.join(f'{v:.2f}' for v in results[mode])}")
    print(f"  uncompiled / mlx-lm   {med['uncompiled'] / med['mlx-lm']:.3f}x")
    print(f"  compiled / uncompiled {med['compiled'] / med['uncompiled']:.3f}x")
    if separate is not None:
        print(f"  compiled / separate layers {med['compiled'] / med['separate layers']:.3f}x (each run: "
              f"{', '.join(f'{a / b:.3f}' for a, b in zip(results['compiled'], results['separate layers']))})")
    step_breakdown(binding, prompt)


if __name__ == "__main__":
    main()
