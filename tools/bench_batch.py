"""Batched decode in-process (the scheduler alone, no HTTP): aggregate tok/s of N sequences stepped
together, pipelined steps against unpipelined ones, against one sequence alone, in one run.

The embedded model with the server's default kernels; N distinct chat prompts, greedy, EOS
barred, prompt lookup on (the server's default); the two batched modes alternate `--repeats`
times and medians are compared, with the CPU cores the process kept busy (2 here: the Python
that builds a step competes with the kernels' threads). Every mode's tokens are checked equal.
Run: `uv run python -m tools.bench_batch [--sequences 8] [--max-tokens 128] [--repeats 5]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlxkv_inference import GenerationParams, SamplingParams, load_binding  # first: the BLAS shim precedes mlx

from mlxkv_inference.engine.generate import Generation  # noqa: E402
from mlxkv_inference.engine.scheduler import BatchScheduler  # noqa: E402
from mlxkv_inference.engine.speculation import SpeculativeParams  # noqa: E402
from mlxkv_inference.models.cpu_kernels import default_cpu_kernels  # noqa: E402
from mlxkv_inference.tokenizer.chat import encode_chat  # noqa: E402
from tools.bench_sampler import PROMPTS  # noqa: E402


def run(scheduler: BatchScheduler, prompts: list[list[int]], params: GenerationParams) -> tuple[float, float, list[tuple[int, ...]]]:
    """(aggregate tok/s, CPU cores busy, every sequence's tokens) of `prompts` stepped together."""
    generations = [Generation(scheduler.binding, prompt, params) for prompt in prompts]
    for generation in generations:
        scheduler.add(generation)
    wall, cpu = time.perf_counter(), time.process_time()
    while scheduler.running:
        scheduler.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = [g.result.token_ids for g in generations if g.result is not None]
    return sum(map(len, tokens)) / wall, cpu / wall, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=8, help="sequences stepped together (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens each sequence generates (default: 128)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each batched mode (default: 5)")
    args = parser.parse_args()
    binding = load_binding(cpu_kernels=default_cpu_kernels())
    binding.warm_up(compiled=True)
    prompts = [encode_chat(binding.tokenizer, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]).tokens
               for i in range(args.sequences)]
    barred = {token: -100.0 for token in binding.eos_token_ids}
    params = GenerationParams(max_tokens=args.max_tokens, sampling=SamplingParams(logit_bias=barred),
                              speculative=SpeculativeParams(mode="prompt_lookup"))
    modes = {"pipelined": True, "unpipelined": False}
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    expected: list[tuple[int, ...]] = []
    for _ in range(args.repeats + 1):  # the first round warms up, uncounted
        for mode, pipelined in modes.items():
            tps, cores, tokens = run(BatchScheduler(binding, max_batch=args.sequences, pipelined=pipelined), prompts, params)
            if expected and tokens != expected:
                raise AssertionError(f"{mode} steps changed a sequence's tokens")
            expected = tokens
            results[mode].append((tps, cores))
    alone = statistics.median(run(BatchScheduler(binding, max_batch=1), prompts[:1], params)[0] for _ in range(3))
    print(f"{args.sequences} sequences x {args.max_tokens} tokens, greedy, prompt lookup; cpu kernels {binding.cpu_kernels}; "
          f"medians of {args.repeats}")
    print(f"  one sequence alone: {alone:.1f} tok/s")
    for mode, runs in results.items():
        tps = statistics.median(t for t, _ in runs[1:])
        cores = statistics.median(c for _, c in runs[1:])
        print(f"  {mode:>11}: {tps:6.1f} tok/s ({' '.join(f'{t:.0f}' for t, _ in runs[1:])}), {tps / alone:.2f}x alone, "
              f"{cores:.2f} cores busy")
    ahead, plain = (statistics.median(t for t, _ in results[mode][1:]) for mode in modes)
    print(f"  pipelined / unpipelined: {ahead / plain:.2f}x; tokens identical in every run")


if __name__ == "__main__":
    main()
