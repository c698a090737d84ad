"""Seeded sampling per row: the native sampler against mlx-lm's filters and MLX's categorical draw,
in one run, on the embedded model's own next-token log-probabilities.

Each setting samples `--rows` rows the way a decode step does (one sampler call and one eval per
generation), from the log-probabilities of the embedded model after a few prompts; ratios are
MLX time / native time from the same run. Both sample the same distribution (tests/
test_native_sampling.py pins the native draw against mlx-lm's filters); the tokens differ.
Run: `uv run python -m tools.bench_sampler [--rows 1 8] [--repeats 30]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlxkv_inference import SamplingParams, load_binding  # first: the BLAS shim precedes mlx

import mlx.core as mx  # noqa: E402, I001

from mlxkv_inference.generation.sampling import make_sampler  # noqa: E402
from mlxkv_inference.tokenizer.chat import encode_chat  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity briefly.",
           "List five fruits.", "Why is the sky blue?", "Name a planet.", "Say hello in French.", "What is a prime number?"]
SETTINGS = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "+ top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "+ top_k 40": SamplingParams(temperature=0.7, top_k=40),
    "+ min_p 0.05": SamplingParams(temperature=0.7, min_p=0.05),
    "top_k 40, top_p 0.95": SamplingParams(temperature=1.0, top_k=40, top_p=0.95),
}


def model_logprobs(rows: int) -> list[mx.array]:
    """The embedded model's (1, vocab) log-probabilities of the token after each of `rows` prompts."""
    binding = load_binding(cpu_kernels="native")
    out = []
    for i in range(rows):
        tokens = encode_chat(binding.tokenizer, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]).tokens
        caches = binding.make_cache()
        binding.prefill(tokens[:-1], caches)
        logprobs = binding.log_softmax(binding.decode(mx.array(tokens[-1:], dtype=mx.uint32), caches))
        mx.eval(logprobs)
        out.append(logprobs)
    return out


def step_seconds(logprobs: list[mx.array], params: SamplingParams, native: bool, repeats: int) -> float:
    """Median seconds to sample every row once, one call and eval per row (as a decode step does)."""
    samplers = [make_sampler(params, seed, native) for seed in range(len(logprobs))]
    times = []
    for step in range(repeats + 1):
        start = time.perf_counter()
        for sampler, row in zip(samplers, logprobs):
            mx.eval(sampler(row, step))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows a step samples (default: 1 8)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    logprobs = model_logprobs(max(args.rows))
    print(f"embedded model log-probabilities ({logprobs[0].shape[-1]}-token vocabulary); ms a step, median of {args.repeats}")
    print(f"  {'setting':22} {'rows':>4} {'mlx-lm + MLX':>13} {'native':>8} {'ratio':>7}")
    for name, params in SETTINGS.items():
        for rows in args.rows:
            reference = step_seconds(logprobs[:rows], params, False, args.repeats)
            native = step_seconds(logprobs[:rows], params, True, args.repeats)
            print(f"  {name:22} {rows:4d} {reference * 1000:13.2f} {native * 1000:8.2f} {reference / native:6.1f}x")


if __name__ == "__main__":
    main()
