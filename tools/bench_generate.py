"""Prefill and decode tokens/s of mlxkv's loop vs mlx-lm's `stream_generate`, in one process.

Both run on the same model object (the embedded SmolLM2 unless --model) with the same prompt ids,
the same prefill chunk and EOS ignored, alternating A/B runs; the report is the median of each and
the ratios (ours / mlx-lm). Run: `uv run python tools/bench_generate.py`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, load_binding
from mlxkv_inference._mlx_lm import mlx_lm_stream_responses, wrap_tokenizer
from mlxkv_inference.tokenizer.gguf_tokenizer import GgufTokenizer

STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had "
    "taught him, and at the top he wound the clockwork that turned the great lens. "
)


@dataclass(frozen=True, slots=True)
class Timing:
    prefill_tps: float
    decode_tps: float


def time_stream(prompt_tokens: int, tokens: Iterable[object]) -> Timing:
    """Time a token stream: prefill = prompt / time to first token, decode = tokens after the first."""
    start = time.perf_counter()
    first = last = 0.0
    n = 0
    for _ in tokens:
        last = time.perf_counter()
        if n == 0:
            first = last
        n += 1
    return Timing(prompt_tokens / (first - start), (n - 1) / (last - first))


def ours(binding: MlxAutoregressiveBinding, prompt: list[int], n: int, chunk: int) -> Timing:
    params = GenerationParams(max_tokens=n, prefill_chunk=chunk, ignore_eos=True)
    return time_stream(len(prompt), Generation(binding, prompt, params))


def theirs(binding: MlxAutoregressiveBinding, prompt: list[int], n: int, chunk: int) -> Timing:
    tokenizer = binding.tokenizer
    assert isinstance(tokenizer, GgufTokenizer), "the mlx-lm reference needs the GGUF tokenizer"
    wrapper = wrap_tokenizer(tokenizer.backend, eos_token_ids=[])
    return time_stream(len(prompt), mlx_lm_stream_responses(binding.model, wrapper, prompt, n, prefill_step_size=chunk))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a llama .gguf file (default: the embedded model)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    binding = load_binding(args.model)
    text_ids = binding.tokenizer.encode(STORY * (1 + args.prompt_tokens // 30))
    prompt = text_ids[: args.prompt_tokens]
    runners: dict[str, Callable[..., Timing]] = {"mlxkv": ours, "mlx-lm": theirs}
    results: dict[str, list[Timing]] = {name: [] for name in runners}
    ours(binding, prompt[:16], 4, args.prefill_chunk)  # warm-up
    for _ in range(args.repeats):
        for name, run in runners.items():
            results[name].append(run(binding, prompt, args.gen_tokens, args.prefill_chunk))
    print(f"model {binding.model_id}: prompt {len(prompt)} tokens, {args.gen_tokens} generated, {args.repeats} runs each (median)")
    medians = {
        name: Timing(statistics.median(t.prefill_tps for t in ts), statistics.median(t.decode_tps for t in ts))
        for name, ts in results.items()
    }
    for name, m in medians.items():
        print(f"  {name:7s} prefill {m.prefill_tps:8.2f} tok/s   decode {m.decode_tps:8.2f} tok/s")
    a, b = medians["mlxkv"], medians["mlx-lm"]
    print(f"  ratio   prefill {a.prefill_tps / b.prefill_tps:8.3f}x        decode {a.decode_tps / b.decode_tps:8.3f}x   (mlxkv / mlx-lm)")


if __name__ == "__main__":
    main()
