"""`mlxkv generate PROMPT`: stream one completion to stdout, one stats line to stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mlxkv_inference import GenerationResult, load_binding
from mlxkv_inference.engine.cached_generation import CachedGenerator
from mlxkv_inference.tokenizer.chat import encode_chat

from mlxkv.commands.options import (
    add_cache_options, add_model_options, add_sampling_options, cpu_kernels_from, generation_params_from,
    kv_scheme_from, runtime_line,
)
from mlxkv.engine.cache_services import build_tiers

FLUSH_TIMEOUT_S = 60.0


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description="Generate a completion for PROMPT and stream it to stdout. The chat template is "
        "applied unless --raw is given; a stats line goes to stderr. Prompt KV is cached on the SSD "
        "(see --ssd-cache), so a repeated or extended prompt is not prefilled again.",
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the user message (or, with --raw, the exact prompt text)")
    parser.add_argument("--raw", action="store_true", help="tokenize PROMPT as-is, without the chat template")
    parser.add_argument("--system", default=None, metavar="TEXT", help="system message placed before the prompt")
    add_model_options(parser)
    add_sampling_options(parser, default_max_tokens=256)
    add_cache_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    params = generation_params_from(args)
    binding = load_binding(args.model, kv_scheme_from(args), cpu_kernels_from(args))
    print(f"mlxkv generate: {runtime_line(binding)}", file=sys.stderr)
    tokenizer = binding.tokenizer
    history_end = None
    if args.raw:
        prompt = tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        chat = encode_chat(tokenizer, messages)
        prompt, history_end = chat.tokens, chat.history_end
    tiers, _ = build_tiers(binding, ram_bytes=args.prompt_cache_bytes, ssd_dir=args.ssd_cache, ssd_bytes=args.ssd_cache_max)
    generator = CachedGenerator(binding, tiers)
    generation = generator.start(prompt, params, history_end=history_end)
    try:
        for delta in generation:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        generator.settle(generation)
    finally:
        if not tiers.close(FLUSH_TIMEOUT_S):
            print("mlxkv generate: warning: the SSD cache write did not finish in time", file=sys.stderr)
    assert generation.result is not None
    print(stats_line(generation.result), file=sys.stderr)
    return 0


def stats_line(result: GenerationResult) -> str:
    return (
        f"prompt: {result.prompt_tokens} tokens ({result.cached_tokens} cached), {result.prefill_tps:.1f} tok/s | "
        f"generation: {result.generated_tokens} tokens, {result.decode_tps:.1f} tok/s | "
        f"ttft: {result.ttft_s:.2f} s | finish: {result.finish_reason} | seed: {result.seed}"
    )
