"""`mlxkv generate PROMPT`: stream one completion to stdout, one stats line to stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mlxkv_inference import Generation, GenerationResult, load_binding

from mlxkv.commands.options import add_model_options, add_sampling_options, generation_params_from, kv_scheme_from


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description="Generate a completion for PROMPT and stream it to stdout. The chat template is "
        "applied unless --raw is given; a stats line goes to stderr.",
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the user message (or, with --raw, the exact prompt text)")
    parser.add_argument("--raw", action="store_true", help="tokenize PROMPT as-is, without the chat template")
    parser.add_argument("--system", default=None, metavar="TEXT", help="system message placed before the prompt")
    add_model_options(parser)
    add_sampling_options(parser, default_max_tokens=256)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    params = generation_params_from(args)
    binding = load_binding(args.model, kv_scheme_from(args))
    tokenizer = binding.tokenizer
    if args.raw:
        prompt = tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    generation = Generation(binding, prompt, params)
    for delta in generation:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    assert generation.result is not None
    print(stats_line(generation.result), file=sys.stderr)
    return 0


def stats_line(result: GenerationResult) -> str:
    return (
        f"prompt: {result.prompt_tokens} tokens ({result.cached_tokens} cached), {result.prefill_tps:.1f} tok/s | "
        f"generation: {result.generated_tokens} tokens, {result.decode_tps:.1f} tok/s | "
        f"ttft: {result.ttft_s:.2f} s | finish: {result.finish_reason} | seed: {result.seed}"
    )
