"""Batched decode in-process (the scheduler alone, no HTTP): aggregate tok/s of N sequences stepped
together, pipelined steps against unpipelined ones, against one sequence alone, in one run.

The embedded model with the server's default kernels; N distinct chat prompts, greedy, EOS
barred, prompt lookup on (the server's default); the two batched modes alternate `--repeats`
times and medians are compared, with the CPU cores the process kept busy (2 here: the Python
that builds a step competes with the kernels' threads). Every mode's tokens are checked equal.
Run: `uv run python -m tools.bench_batch [--sequences 8] [--max-tokens 128] [--repeats 5]`; `--model
gemma3-270m` on the `gemma3` group's base model (raw-text prompts), `--per-row` adds a batch run as a
graph per row (the fallback where rows cannot be stacked).

`--timeline`: instead, N requests arriving at once on a scheduler bounding a step's prefill as
`mlxkv serve` does (`--prefill-step-ms`, default the server's): each step's time, the generations
decoding and prefilling, and the tokens it produced; then how long the prompts took to prefill and
what an N-row step cost after, against one sequence's plain step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from mlxkv_inference import GenerationParams, MlxAutoregressiveBinding, SamplingParams, load_binding  # first: the BLAS shim precedes mlx

from mlxkv_inference.generation.generate import Generation  # noqa: E402
from mlxkv_inference.scheduler.decode_step import STEP_MAX_ROWS  # noqa: E402
from mlxkv_inference.scheduler.batch import BatchScheduler  # noqa: E402
from mlxkv_inference.speculative.speculation import SpeculativeParams  # noqa: E402
from mlxkv_inference.native.kernels import default_cpu_kernels  # noqa: E402
from mlxkv_inference.tokenizer.chat import encode_chat  # noqa: E402
from mlxkv.commands.serve import SERVE_PREFILL_STEP_MS  # noqa: E402
from mlxkv.paths import default_cache_dir  # noqa: E402
from mlxkv_inference.models.gemma3_270m import gemma3_270m_path  # noqa: E402
from tools.bench_generate import cpu_model  # noqa: E402
from tools.bench_sampler import PROMPTS  # noqa: E402


def run(scheduler: BatchScheduler, prompts: list[list[int]], params: GenerationParams,
        decode_only: bool = False) -> tuple[float, float, list[tuple[int, ...]]]:
    """(aggregate tok/s, CPU cores busy, every sequence's tokens) of `prompts` stepped together;
    `decode_only`: counted from the first step after every prompt has prefilled."""
    generations = [Generation(scheduler.binding, prompt, params) for prompt in prompts]
    for generation in generations:
        scheduler.add(generation)
    while decode_only and (len(scheduler.running) < len(generations) or any(g.prefilling for g in scheduler.running)):
        scheduler.step()
    before = sum(g.produced for g in generations)
    wall, cpu = time.perf_counter(), time.process_time()
    while scheduler.running:
        scheduler.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = [g.result.token_ids for g in generations if g.result is not None]
    return (sum(map(len, tokens)) - before) / wall, cpu / wall, tokens


def timeline(binding: MlxAutoregressiveBinding, prompts: list[list[int]], params: GenerationParams,
             prefill_step_s: float) -> None:
    """Prints each step of `prompts` arriving together (after one uncounted run)."""
    for _ in range(2):  # the first run warms up, uncounted
        scheduler = BatchScheduler(binding, max_batch=len(prompts), prefill_step_s=prefill_step_s)
        for prompt in prompts:
            scheduler.add(Generation(binding, prompt, params))
        steps: list[tuple[float, float, int, int, int]] = []  # start, seconds, decoding, prefilling, tokens
        start = time.perf_counter()
        while scheduler.running:
            began = time.perf_counter()
            prefilling = sum(1 for g in scheduler.running if g.prefilling)
            decoding = len(scheduler.running) - prefilling
            tokens = sum(len(outcome.deltas) for outcome in scheduler.step())
            steps.append((began - start, time.perf_counter() - began, decoding, prefilling, tokens))
    for at, seconds, decoding, prefilling, tokens in steps:
        print(f"  {at:7.3f} s  step {seconds * 1000:6.1f} ms  decoding {decoding}  prefilling {prefilling}  tokens {tokens}")
    prefill_end = next(at for at, _, _, prefilling, _ in steps if prefilling == 0)
    full = [seconds for _, seconds, decoding, prefilling, tokens in steps
            if decoding == len(prompts) and not prefilling and tokens == len(prompts)]
    single = Generation(binding, prompts[0], params).run()
    plain = (f"a plain {len(prompts)}-row step (no drafts) median {statistics.median(full) * 1000:.1f} ms over "
             f"{len(full)} steps" if full else f"no plain {len(prompts)}-row step (raise --max-tokens)")
    print(f"{len(prompts)} prompts of {', '.join(str(len(p)) for p in prompts)} tokens arriving together, prefill steps "
          f"bounded to {prefill_step_s * 1000:.0f} ms: prefilled after {prefill_end:.2f} s of "
          f"{steps[-1][0] + steps[-1][1]:.2f} s; {plain}, one sequence alone {1000 / single.decode_tps:.1f} ms a token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=8, help="sequences stepped together (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens each sequence generates (default: 128)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each batched mode (default: 5)")
    parser.add_argument("--timeline", action="store_true", help="print each step of the sequences arriving at once instead")
    parser.add_argument("--prefill-step-ms", type=float, default=SERVE_PREFILL_STEP_MS,
                        help=f"--timeline: the scheduler's prefill time bound a step (default: the server's, {SERVE_PREFILL_STEP_MS:.0f})")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a local mlx-lm directory or .gguf file, or gemma3-270m (the `gemma3` group's base model: "
                             "its prompts are the requests as raw text) (default: the embedded model)")
    parser.add_argument("--no-speculation", action="store_true",
                        help="plain steps only (default: prompt lookup, the server's default)")
    parser.add_argument("--prompt-tokens", type=int, default=0, metavar="N",
                        help="lengthen each prompt to N tokens (its text repeated; Gemma 3: N > 512 decodes past its "
                             "sliding window); tok/s then count from when every prompt has prefilled "
                             "(default: the requests as they are, tok/s from the start)")
    parser.add_argument("--per-row", action="store_true",
                        help="also run the batch with a graph per row (what the scheduler falls back to where rows "
                             "cannot be stacked), for comparison")
    args = parser.parse_args()
    base = args.model == "gemma3-270m"
    model = str(gemma3_270m_path(default_cache_dir())) if base else args.model
    binding = load_binding(model, cpu_kernels=default_cpu_kernels())
    binding.warm_up(compiled=True, rows=STEP_MAX_ROWS)
    requests = [PROMPTS[i % len(PROMPTS)] for i in range(args.sequences)]
    if args.prompt_tokens:
        requests = [" ".join([f"({i})", *[r] * (args.prompt_tokens // 4 + 1)]) for i, r in enumerate(requests)]
    prompts = [binding.tokenizer.encode(r) if base else encode_chat(binding.tokenizer, [{"role": "user", "content": r}]).tokens
               for r in requests]
    if args.prompt_tokens:
        prompts = [p[: args.prompt_tokens] for p in prompts]
    print(f"{binding.model_id}; cpu {cpu_model()}; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    barred = {token: -100.0 for token in binding.eos_token_ids}
    params = GenerationParams(max_tokens=args.max_tokens, sampling=SamplingParams(logit_bias=barred),
                              speculative=SpeculativeParams(mode="off" if args.no_speculation else "prompt_lookup"))
    if args.timeline:
        timeline(binding, prompts, params, args.prefill_step_ms / 1000)
        return
    modes = {"pipelined": True, "unpipelined": False}
    if args.per_row:
        modes["graph per row"] = True
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    expected: list[tuple[int, ...]] = []
    stacks = binding.can_decode_batch
    for _ in range(args.repeats + 1):  # the first round warms up, uncounted
        for mode, pipelined in modes.items():
            # the scheduler asks the binding whether rows stack; "graph per row" answers no
            setattr(binding, "can_decode_batch", (lambda *a, **k: False) if mode == "graph per row" else stacks)
            tps, cores, tokens = run(BatchScheduler(binding, max_batch=args.sequences, pipelined=pipelined), prompts, params,
                                     decode_only=bool(args.prompt_tokens))
            if expected and tokens != expected:
                raise AssertionError(f"{mode} steps changed a sequence's tokens")
            expected = tokens
            results[mode].append((tps, cores))
    alone = statistics.median(run(BatchScheduler(binding, max_batch=1), prompts[:1], params, bool(args.prompt_tokens))[0]
                              for _ in range(3))
    print(f"{args.sequences} sequences x {args.max_tokens} tokens, greedy, "
          f"{'no speculation' if args.no_speculation else 'prompt lookup'}; cpu kernels {binding.cpu_kernels}; "
          f"medians of {args.repeats}")
    print(f"  one sequence alone: {alone:.1f} tok/s")
    for mode, runs in results.items():
        tps = statistics.median(t for t, _ in runs[1:])
        cores = statistics.median(c for _, c in runs[1:])
        print(f"  {mode:>11}: {tps:6.1f} tok/s ({' '.join(f'{t:.0f}' for t, _ in runs[1:])}), {tps / alone:.2f}x alone, "
              f"{cores:.2f} cores busy")
    setattr(binding, "can_decode_batch", stacks)
    ahead, plain = (statistics.median(t for t, _ in results[mode][1:]) for mode in ("pipelined", "unpipelined"))
    print(f"  pipelined / unpipelined: {ahead / plain:.2f}x; tokens identical in every run")


if __name__ == "__main__":
    main()
