"""`mlxkv generate PROMPT`: stream one completion to stdout, one stats line to stderr."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxkv_inference import Grammar, GenerationResult, compile_grammar, load_binding
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.tokenizer.chat import encode_chat

from mlxkv.commands.adapter_options import add_adapter_options, load_adapters
from mlxkv.engine.adapters import AdapterRegistry
from mlxkv.commands.options import (
    add_cache_options, add_model_options, add_sampling_options, add_speculative_options, cpu_kernels_from,
    apply_batch_exactness, generation_params_from, kv_scheme_from, prepare_speculation, runtime_line,
)
from mlxkv.engine.cache_services import build_tiers
from mlxkv.paths import weights_digest_memo
from mlxkv.progress import TerminalProgress
from mlxkv.engine.model_sources import is_hub_id, resolve_source

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
    shape = parser.add_argument_group("structured output").add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="SCHEMA", default=None,
                       help="answer with JSON that matches SCHEMA (a JSON schema, inline or a file path)")
    shape.add_argument("--grammar", metavar="FILE", type=Path, default=None, help="answer in the Lark grammar in FILE (llguidance's dialect)")
    shape.add_argument("--regex", metavar="PATTERN", default=None, help="answer with text that matches PATTERN")
    add_model_options(parser)
    add_sampling_options(parser, default_max_tokens=256)
    add_speculative_options(parser, server=False)
    add_cache_options(parser)
    add_adapter_options(parser, server=False)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    params = replace(generation_params_from(args), grammar=grammar_from(args))
    progress = TerminalProgress()
    progress.status(f"loading {args.model or 'the embedded model'} ...")
    hub = args.model is not None and is_hub_id(args.model)
    binding = load_binding(resolve_source(args.model), kv_scheme_from(args), cpu_kernels_from(args),
                           digest_memo=weights_digest_memo(), model_id=args.model if hub else None)
    apply_batch_exactness(args, binding)
    draft = prepare_speculation(args, binding)
    adapters = AdapterRegistry(binding.adapters, binding.model_id)
    load_adapters(args, adapters)
    progress.clear()
    print(f"mlxkv generate: {runtime_line(binding)}", file=sys.stderr)
    tokenizer = binding.tokenizer
    if params.grammar is not None:
        compile_grammar(params.grammar, tokenizer)
    history_end = None
    if args.raw:
        prompt = tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        chat = encode_chat(tokenizer, messages)
        prompt, history_end = chat.tokens, chat.history_end
    tiers, _ = build_tiers(binding, ram_bytes=args.prompt_cache_bytes, ssd_dir=args.ssd_cache, ssd_bytes=args.ssd_cache_max)
    generator = CachedGenerator(binding, tiers, draft)
    stack = adapters.select(None, [option.name for option in args.adapter])
    generation = generator.start(prompt, params, stack, history_end=history_end, on_prefill_progress=progress.prefill)
    try:
        for delta in generation:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        generator.settle(generation)
    finally:
        closed = tiers.close(FLUSH_TIMEOUT_S)
        if not closed.settled:
            print("mlxkv generate: warning: the SSD cache write did not finish in time", file=sys.stderr)
        if closed.failed:
            print(f"mlxkv generate: warning: {closed.failed} SSD cache writes failed (see the log above)", file=sys.stderr)
    assert generation.result is not None
    print(stats_line(generation.result), file=sys.stderr)
    return 0


def grammar_from(args: argparse.Namespace) -> Grammar | None:
    """The grammar --json-schema, --grammar or --regex asks for (None without them)."""
    if args.regex is not None:
        return Grammar("regex", args.regex)
    if args.grammar is not None:
        return Grammar("lark", args.grammar.read_text())
    if args.json_schema is None:
        return None
    text = args.json_schema if args.json_schema.lstrip().startswith("{") else Path(args.json_schema).read_text()
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("--json-schema must be a JSON object (a JSON schema)")
    return Grammar.json_schema(schema)


def stats_line(result: GenerationResult) -> str:
    speculation = ""
    if result.draft_tokens:
        rate = result.accepted_tokens / result.draft_tokens
        speculation = f" | drafts: {result.accepted_tokens}/{result.draft_tokens} accepted ({rate:.0%})"
    return (
        f"prompt: {result.prompt_tokens} tokens ({result.cached_tokens} cached), {result.prefill_tps:.1f} tok/s | "
        f"generation: {result.generated_tokens} tokens, {result.decode_tps:.1f} tok/s | "
        f"ttft: {result.ttft_s:.2f} s | finish: {result.finish_reason} | seed: {result.seed}{speculation}"
    )
