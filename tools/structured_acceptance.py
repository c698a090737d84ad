"""Acceptance run: 20 JSON schemas x {greedy, seeded} on the embedded model; every answer must parse
and validate with `jsonschema`.

    uv run python tools/structured_acceptance.py [--max-tokens 128] [--only N]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jsonschema

from mlxkv_inference import Generation, GenerationParams, Grammar, SamplingParams, load_binding
from mlxkv_inference.tokenizer.chat import encode_chat


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city and its country", obj({"city": NAME, "country": NAME})),
    ("a yes or no answer to: is water wet?", obj({"answer": {"enum": ["yes", "no"]}})),
    ("a temperature reading", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("three colours", obj({"colours": {"type": "array", "items": NAME, "minItems": 3, "maxItems": 3}})),
    ("a book", obj({"title": NAME, "author": NAME, "year": {"type": "integer", "minimum": 1450, "maximum": 2030}})),
    ("a point in 2D", obj({"x": {"type": "number"}, "y": {"type": "number"}})),
    ("a user with an address", obj({"user": NAME, "address": obj({"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("a todo item", obj({"task": NAME, "done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}})),
    ("a shopping list", obj({"items": {"type": "array", "items": obj({"item": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                                       "minItems": 1, "maxItems": 3}})),
    ("a rating of a film", obj({"film": NAME, "stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("a product with an optional discount", obj({"product": NAME, "price": {"type": "number", "minimum": 0, "maximum": 1000},
                                                 "discount": {"type": "number", "minimum": 0, "maximum": 0.9}}, ["product", "price"])),
    ("an email message", obj({"to": NAME, "subject": NAME, "urgent": {"type": "boolean"}})),
    ("a weekday", obj({"day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]}})),
    ("a list of prime numbers below 20", obj({"primes": {"type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 19},
                                                        "maxItems": 8}})),
    ("a recipe", obj({"dish": NAME, "minutes": {"type": "integer", "minimum": 1, "maximum": 300},
                      "steps": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}})),
    ("a tree of one parent and children", obj({"parent": NAME, "children": {"type": "array", "items": obj({"name": NAME}), "maxItems": 3}})),
    ("a server status", obj({"host": NAME, "up": {"type": "boolean"}, "load": {"type": "number", "minimum": 0, "maximum": 1},
                             "tags": {"type": "array", "items": {"enum": ["web", "db", "cache"]}, "maxItems": 3}})),
    ("a nullable middle name", obj({"first": NAME, "middle": {"anyOf": [NAME, {"type": "null"}]}, "last": NAME})),
    ("a coordinate pair with a label", obj({"label": NAME, "lat": {"type": "number", "minimum": -90, "maximum": 90},
                                            "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
]
SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=1234)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--only", type=int, default=len(SCHEMAS), help="run the first N schemas")
    args = parser.parse_args()
    binding = load_binding()
    passed = total = 0
    t0 = time.perf_counter()
    for what, schema in SCHEMAS[: args.only]:
        jsonschema.Draft202012Validator.check_schema(schema)
        prompt = encode_chat(binding.tokenizer, [{"role": "user", "content": f"Reply with {what} as JSON."}]).tokens
        for label, sampling in SAMPLINGS.items():
            params = GenerationParams(max_tokens=args.max_tokens, sampling=sampling, grammar=Grammar.json_schema(schema))
            result = Generation(binding, prompt, params).run()
            total += 1
            try:
                jsonschema.validate(json.loads(result.text), schema)
            except (ValueError, jsonschema.ValidationError) as e:
                print(f"FAIL {what!r} {label} ({result.finish_reason}, {result.generated_tokens} tokens): {result.text!r}: {e}")
                continue
            passed += 1
            print(f"ok   {what!r} {label} ({result.generated_tokens} tokens): {result.text}")
    print(f"{passed}/{total} answers parse and validate ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
