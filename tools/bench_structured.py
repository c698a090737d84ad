"""Decode tokens/s with and without a JSON-schema constraint, in one run (target: the constraint
costs <= 5% of decode).

Same model (the embedded SmolLM2), same prompt; the constrained run asks for a long array of objects
so that both runs decode exactly `--tokens` tokens. Runs alternate; medians are compared. Then the
mask alone is timed (matcher mask + unpack + where on the logits), for scale against a decode step.
Run: `uv run python tools/bench_structured.py`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlxkv_inference import Generation, GenerationParams, Grammar, GrammarConstraint, load_binding  # first: the BLAS shim precedes mlx

import mlx.core as mx  # noqa: E402, I001
from mlxkv_inference.tokenizer.chat import encode_chat

SCHEMA = {"type": "array", "minItems": 500, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 12},
                                     "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"], "additionalProperties": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description="decode tok/s with and without a JSON-schema constraint")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    binding = load_binding()
    prompt = encode_chat(binding.tokenizer, [{"role": "user", "content": "List some users as JSON."}]).tokens
    grammar = Grammar.json_schema(SCHEMA)
    runs: dict[str, list[float]] = {"free": [], "json_schema": []}
    for _ in range(args.repeats):
        for label, g in (("free", None), ("json_schema", grammar)):
            result = Generation(binding, prompt, GenerationParams(max_tokens=args.tokens, ignore_eos=g is None, grammar=g)).run()
            assert result.generated_tokens == args.tokens, (label, result.generated_tokens, result.text)
            runs[label].append(result.decode_tps)
    free, constrained = (statistics.median(runs[k]) for k in ("free", "json_schema"))
    print(f"decode tok/s, median of {args.repeats} x {args.tokens} tokens: free {free:.2f}, json_schema {constrained:.2f}, "
          f"constraint cost {100 * (1 - constrained / free):+.1f}%")
    print(f"  runs: free {[round(x, 2) for x in runs['free']]}, json_schema {[round(x, 2) for x in runs['json_schema']]}")
    constraint = GrammarConstraint(grammar, binding.tokenizer)
    for token in binding.tokenizer.encode('[{"id": 1, "name": "ab', add_special_tokens=False):
        constraint.consume(token)
    logits = mx.zeros((1, binding.tokenizer.vocab_size))
    times = []
    for _ in range(200):
        start = time.perf_counter()
        mx.eval(constraint.apply(logits))
        times.append(time.perf_counter() - start)
    mask_s = statistics.median(times)
    print(f"mask alone (matcher + unpack + where, evaluated): median {1e6 * mask_s:.0f} us, "
          f"{100 * mask_s * free:.2f}% of a free decode step (an upper bound: it overlaps the forward pass)")


if __name__ == "__main__":
    main()
