"""Grammar-constrained decoding: every answer matches its grammar, and resuming stays exact."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest

from mlxkv_inference import Generation, GenerationParams, Grammar, GrammarConstraint, SamplingParams, compile_grammar
from mlxkv_inference.cache.reuse import clone_trimmed
from mlxkv_inference.generation.results import CheckpointState, ResumePoint
from mlxkv.engine.checkpoints import request_key
from tests.factories import EOS_ID, TINY_VOCAB, ByteTokenizer, make_identity, make_prompt, make_tiny_binding

SEEDED = SamplingParams(temperature=1.0, seed=5)
PATTERN = r"[a-z]{3}-[0-9]{2,4}"


@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_regex_constrained_text_matches_and_ends_with_eos(sampling: SamplingParams) -> None:
    binding = make_tiny_binding("llama")
    params = GenerationParams(max_tokens=20, sampling=sampling, grammar=Grammar("regex", PATTERN))
    result = Generation(binding, make_prompt(8), params).run()
    assert re.fullmatch(PATTERN, result.text), result.text
    assert result.finish_reason == "stop"  # the grammar let EOS through only once it accepted


def test_unconstrained_tiny_model_does_not_match_the_pattern() -> None:
    """The oracle for the test above: without the mask the same greedy run produces other text."""
    binding = make_tiny_binding("llama")
    result = Generation(binding, make_prompt(8), GenerationParams(max_tokens=20)).run()
    assert not re.fullmatch(PATTERN, result.text)


def test_json_schema_constrained_text_parses_and_validates() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9},
                                               "c": {"enum": ["x", "y"]}}, "required": ["n", "c"], "additionalProperties": False}
    binding = make_tiny_binding("qwen3")
    params = GenerationParams(max_tokens=60, sampling=SEEDED, grammar=Grammar.json_schema(schema))
    value = json.loads(Generation(binding, make_prompt(8), params).run().text)
    assert set(value) == {"n", "c"} and 3 <= value["n"] <= 9 and value["c"] in ("x", "y")


def test_resumed_constrained_generation_replays_its_matcher() -> None:
    binding = make_tiny_binding("llama")
    prompt = make_prompt(10)
    params = GenerationParams(max_tokens=24, sampling=SEEDED, grammar=Grammar("regex", r"([a-f]{2} ){3,8}[0-9]"))
    states: list[CheckpointState] = []
    full = Generation(binding, prompt, params, checkpoint_every=4, on_checkpoint=states.append).run()
    assert re.fullmatch(r"([a-f]{2} ){3,8}[0-9]", full.text)
    assert len(states) >= 2
    for state in states:
        resumed = Generation(binding, prompt, params, caches=clone_trimmed(state.caches, len(prompt) + len(state.generated)),
                             resume=ResumePoint(state.generated, state.pending)).run()
        assert resumed.token_ids == full.token_ids


def test_mask_allows_eos_only_where_the_grammar_accepts() -> None:
    constraint = GrammarConstraint(Grammar("regex", "ab"), ByteTokenizer())
    logits = mx.zeros((1, TINY_VOCAB))
    a, b = ByteTokenizer().encode("ab")
    allowed = allowed_ids(constraint.apply(logits))
    assert allowed == [a]
    constraint.consume(a)
    constraint.consume(b)
    allowed = allowed_ids(constraint.apply(logits))
    assert allowed == [EOS_ID] and constraint.accepting


@pytest.mark.parametrize("grammar", [Grammar("lark", "start: foo"), Grammar("regex", "a(b"),
                                     Grammar("json_schema", '{"type": "nonsense"}'), Grammar("json_schema", "[1]")])
def test_grammar_that_does_not_compile_is_a_value_error(grammar: Grammar) -> None:
    with pytest.raises(ValueError, match="does not compile|not a JSON object"):
        compile_grammar(grammar, ByteTokenizer())


def allowed_ids(masked: mx.array) -> list[int]:
    finite = mx.isfinite(masked[0])
    return [i for i in range(masked.shape[-1]) if bool(finite[i])]


def test_grammar_is_part_of_the_checkpoint_request_key() -> None:
    identity = make_identity(make_tiny_binding("llama"))
    prompt = make_prompt(6)
    free = GenerationParams(max_tokens=8)
    keys = {request_key(identity, "", prompt, free)}
    keys |= {request_key(identity, "", prompt, GenerationParams(max_tokens=8, grammar=Grammar("regex", source))) for source in ("a+", "b+")}
    assert len(keys) == 3
    again = GenerationParams(max_tokens=8, grammar=Grammar("regex", "a+"))
    assert request_key(identity, "", prompt, again) in keys


def test_ignore_eos_with_a_grammar_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="ignore_eos"):
        GenerationParams(ignore_eos=True, grammar=Grammar("regex", "a"))
