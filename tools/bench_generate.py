"""Prefill and decode tokens/s: mlx-lm's `stream_generate`, mlxkv on MLX's kernels and mlxkv on
the native CPU kernels, in one process.

mlx-lm and `mlxkv mlx` run on the same model object (the embedded SmolLM2 unless --model); `mlxkv
native` on a second copy with the native kernels swapped in. Same prompt ids, prefill chunk, EOS
ignored, runs alternate; the report is the median per prompt size and the ratios against mlx-lm.
Run: `uv run python tools/bench_generate.py [--sizes 512 2048]` (smaller sizes for a quick run);
Gemma 3 270M: `uv sync --group gemma3`, then `--model gemma3-270m`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mlxkv.paths import default_cache_dir
from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, load_binding
from mlxkv_inference._mlx_lm import mlx_lm_stream_responses, wrap_tokenizer
from mlxkv_inference._blas import blas_description
from mlxkv_inference.native.kernels import describe_cpu_kernels
from mlxkv_inference.models.gemma3_270m import gemma3_270m_path
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
    parser.add_argument("--model", default=None,
                        help="a .gguf file, or gemma3-270m (the `gemma3` group's model; default: the embedded model)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048], help="prompt sizes in tokens")
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-native", dest="native", action="store_false", help="only mlx-lm and mlxkv mlx")
    parser.add_argument("--native-only", action="store_true",
                        help="only mlxkv native (the MLX-kernel runs of a long prompt can take many minutes)")
    parser.add_argument("--mlx-max-size", type=int, default=None, metavar="N",
                        help="skip the MLX-kernel runs (mlx-lm, mlxkv mlx) of prompts over N tokens, saying so "
                             "(their prefill of a 16k prompt takes many minutes on a small machine)")
    args = parser.parse_args()
    if args.model == "gemma3-270m":
        args.model = gemma3_270m_path(default_cache_dir())
    print(f"cpu {cpu_model()}, {os.cpu_count()} cores")
    binding = load_binding(args.model, cpu_kernels="native" if args.native_only else "mlx")
    bindings = {"mlxkv native": binding} if args.native_only else {"mlx-lm": binding, "mlxkv mlx": binding}
    if args.native and not args.native_only:
        bindings["mlxkv native"] = load_binding(args.model, cpu_kernels="native")
    runners: dict[str, Callable[..., Timing]] = {"mlx-lm": theirs, "mlxkv mlx": ours, "mlxkv native": ours}
    print(f"model {binding.model_id}: {args.gen_tokens} generated, chunk {args.prefill_chunk}, "
          f"{args.repeats} run(s) each (median); BLAS {blas_description()}")
    for name, b in bindings.items():
        if name != "mlx-lm":
            print(f"  {name}: cpu kernels {describe_cpu_kernels(b.cpu_kernels)}")
    text_ids = binding.tokenizer.encode(STORY * (1 + max(args.sizes) // 30))
    for b in dict.fromkeys(bindings.values()):
        ours(b, text_ids[:16], 4, args.prefill_chunk)  # warm-up
    for size in args.sizes:
        prompt = text_ids[:size]
        running = {name: b for name, b in bindings.items()
                   if name == "mlxkv native" or args.mlx_max_size is None or size <= args.mlx_max_size}
        results: dict[str, list[Timing]] = {name: [] for name in running}
        for _ in range(args.repeats):
            for name, b in running.items():
                results[name].append(runners[name](b, prompt, args.gen_tokens, args.prefill_chunk))
        skipped = [name for name in bindings if name not in running]
        report(len(prompt), results, skipped, args.mlx_max_size)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report(prompt_tokens: int, results: dict[str, list[Timing]], skipped: list[str], mlx_max_size: int | None) -> None:
    medians = {
        name: Timing(statistics.median(t.prefill_tps for t in ts), statistics.median(t.decode_tps for t in ts))
        for name, ts in results.items()
    }
    ref = medians.get("mlx-lm", next(iter(medians.values())))
    print(f"prompt {prompt_tokens} tokens:")
    for name, m in medians.items():
        print(f"  {name:12s} prefill {m.prefill_tps:8.2f} tok/s ({m.prefill_tps / ref.prefill_tps:6.2f}x)"
              f"   decode {m.decode_tps:8.2f} tok/s ({m.decode_tps / ref.decode_tps:6.2f}x)")
    for name in skipped:
        print(f"  {name:12s} skipped: prompt over --mlx-max-size {mlx_max_size}")


if __name__ == "__main__":
    main()
