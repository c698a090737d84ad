"""Pipelined decode steps: the scheduler builds the next batched step while the last one evaluates,
each row fed the token it drew before that token is read. Every sequence still gets the tokens,
checkpoints and caches of running alone; a generation that ends (or is cancelled) on a token in
flight drops the token it fed on again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
import pytest

from mlxkv_inference import Generation, GenerationParams, Grammar, MlxAutoregressiveBinding, SamplingParams
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import covered_tokens
from mlxkv_inference.generation.results import CheckpointState
from mlxkv_inference.scheduler.batch import BatchScheduler
from mlxkv_inference.scheduler.outcome import StepOutcome
from mlxkv_inference.speculative.speculation import SpeculativeParams
from mlxkv_inference.step_costs import StepCosts
from tests.factories import make_prompt, make_tiny_binding
from tests.test_prefill_interrupt import states

Spec = tuple[list[int], GenerationParams]


class RowsCostAStep(StepCosts):
    """Step costs where every position costs a whole step, whatever is measured: drafting never
    pays, so a prompt-lookup row runs plain steps (only guessing) whatever this machine's timings."""

    def record(self, rows: int, seconds: float) -> None:
        pass

    def seconds(self, rows: int) -> float | None:
        return float(rows)


def tiny(native: bool, kind: str = "llama") -> MlxAutoregressiveBinding:
    """A tiny llama (or Gemma 3, whose 8-token sliding windows the generations run past): float32
    through MLX, or the server's native kernels on 4-bit weights."""
    binding = make_tiny_binding(kind, seed=4, native=native)
    binding.step_costs = RowsCostAStep()
    return binding


def specs(binding: MlxAutoregressiveBinding) -> list[Spec]:
    """Greedy and seeded rows (penalties, a logit bias, prompt lookup), different max_tokens, and
    one row that ends on a stop string mid-way."""
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=7, repetition_penalty=1.1, logit_bias={3: 2.0})
    rows = [
        (make_prompt(5, seed=1), GenerationParams(max_tokens=17, ignore_eos=True)),
        (make_prompt(13, seed=2), GenerationParams(max_tokens=11, ignore_eos=True, sampling=sampled)),
        (make_prompt(9, seed=3), GenerationParams(max_tokens=23, ignore_eos=True,
                                                  speculative=SpeculativeParams(mode="prompt_lookup"))),
        (make_prompt(7, seed=4), GenerationParams(max_tokens=20, ignore_eos=True)),
    ]
    prompt, params = rows[3]
    text = binding.tokenizer.decode(list(Generation(binding, prompt, params).run().token_ids))
    rows[3] = (prompt, replace(params, stop=(text[6:8],)))  # ends on its 7th or 8th token
    return rows


def run_alone(binding: MlxAutoregressiveBinding, spec: Spec, **generation: Any) -> Generation:
    alone = Generation(binding, *spec, **generation)
    alone.run()
    return alone


def run_batch(binding: MlxAutoregressiveBinding, generations: list[Generation], join: Generation | None = None,
              cancel: Generation | None = None) -> BatchScheduler:
    """Step `generations` together to the end; `join` is added once steps run pipelined, and
    `cancel` is cancelled then, with a token in flight."""
    scheduler = BatchScheduler(binding, max_batch=8)
    for generation in generations:
        scheduler.add(generation)
    while scheduler.running:
        if scheduler.pipelined_steps == 3:
            if join is not None and join not in scheduler.running and join.result is None:
                scheduler.add(join)
            if cancel is not None and not cancel.cancelled:
                assert cancel.in_flight == 1
                cancel.cancel()
        scheduler.step()
    return scheduler


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
@pytest.mark.parametrize("native", [False, True], ids=["float32", "4bit-native"])
def test_pipelined_steps_give_every_sequence_its_tokens_and_caches_alone(native: bool, kind: str) -> None:
    binding = tiny(native, kind)
    rows = specs(binding)
    alone = [run_alone(binding, spec) for spec in rows]
    assert alone[3].result is not None and alone[3].result.finish_reason == "stop"
    joining = (make_prompt(6, seed=9), GenerationParams(max_tokens=9, ignore_eos=True))
    generations = [Generation(binding, *spec) for spec in rows]
    join = Generation(binding, *joining)
    scheduler = run_batch(binding, generations, join=join)
    assert scheduler.pipelined_steps > 3 and join.result is not None
    for got, want in zip([*generations, join], [*alone, run_alone(binding, joining)]):
        assert got.result is not None and want.result is not None
        assert (got.result.token_ids, got.result.finish_reason) == (want.result.token_ids, want.result.finish_reason)
        # Ended with a token in flight or not: the caches hold what the lone run's hold.
        assert covered_tokens(got.caches) == covered_tokens(want.caches)
        assert all(mx.array_equal(a, b).item() for a, b in zip(states(got.caches), states(want.caches), strict=True))


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_a_generation_cancelled_with_a_token_in_flight_drops_it_and_the_others_go_on(kind: str) -> None:
    binding = tiny(True, kind)
    rows = specs(binding)[:3]
    generations = [Generation(binding, *spec) for spec in rows]
    run_batch(binding, generations, cancel=generations[0])
    cancelled = generations[0].result
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    full = run_alone(binding, rows[0]).result
    assert full is not None and 0 < len(cancelled.token_ids) < len(full.token_ids)
    assert cancelled.token_ids == full.token_ids[: len(cancelled.token_ids)]
    # The last token read is the pending one, never fed: as a cancelled lone run leaves it.
    assert covered_tokens(generations[0].caches) == len(rows[0][0]) + len(cancelled.token_ids) - 1
    for got, spec in zip(generations[1:], rows[1:]):
        want = run_alone(binding, spec).result
        assert got.result is not None and want is not None and got.result.token_ids == want.token_ids


def test_checkpoints_under_pipelined_steps_are_those_of_running_alone() -> None:
    binding = tiny(True)
    rows = specs(binding)[:3]

    def checkpointed(generation_of: Any) -> list[tuple[Any, ...]]:
        taken: list[CheckpointState] = []
        generation_of(taken.append)
        return [(c.generated, c.pending, c.seed, [a.tolist() for a in states(c.caches)], c.pending_logprobs.tolist())
                for c in taken]

    def alone(on_checkpoint: Any) -> None:
        Generation(binding, *rows[1], checkpoint_every=3, on_checkpoint=on_checkpoint).run()

    def batched(on_checkpoint: Any) -> None:
        generations = [Generation(binding, *spec) for spec in rows]
        generations[1] = Generation(binding, *rows[1], checkpoint_every=3, on_checkpoint=on_checkpoint)
        assert run_batch(binding, generations).pipelined_steps > 0

    want = checkpointed(alone)
    assert len(want) == 3 and checkpointed(batched) == want


def test_a_row_that_needs_its_last_token_first_keeps_steps_unpipelined_and_exact() -> None:
    binding = tiny(True)
    rows = specs(binding)[:3]
    rows[0] = (rows[0][0], replace(rows[0][1], grammar=Grammar("regex", r"[a-z]{3}-[0-9]{2,4}"), ignore_eos=False))
    generations = [Generation(binding, *spec) for spec in rows]
    scheduler = BatchScheduler(binding, max_batch=8)
    for generation in generations:
        scheduler.add(generation)
    while generations[0].result is None:  # its grammar masks each step by the token before it
        scheduler.step()
    assert scheduler.pipelined_steps == 0 and scheduler.batched_steps > 0
    while scheduler.running:
        scheduler.step()
    assert scheduler.pipelined_steps > 0
    for got, spec in zip(generations, rows):
        want = run_alone(binding, spec).result
        assert got.result is not None and want is not None and got.result.token_ids == want.token_ids


class FailsOnBatch(MlxAutoregressiveBinding):
    """Its `fail_at`-th batched forward raises (0: none does)."""

    fail_at = 0
    batches = 0

    def decode_batch(self, tokens: mx.array, caches: Sequence[list[LayerCache]],
                     lengths: Sequence[int] | None = None, logits_of: Sequence[int] | None = None) -> mx.array:
        self.batches += 1
        if self.batches == self.fail_at:
            raise RuntimeError("injected batched forward failure")
        return super().decode_batch(tokens, caches, lengths, logits_of)


def test_a_pipelined_forward_that_fails_fails_only_the_rows_it_fed() -> None:
    binding = make_tiny_binding("llama", seed=4, native=True, binding_class=FailsOnBatch)
    assert isinstance(binding, FailsOnBatch)
    binding.step_costs = RowsCostAStep()
    rows = [(make_prompt(5, seed=1), GenerationParams(max_tokens=12, ignore_eos=True)),
            (make_prompt(9, seed=2), GenerationParams(max_tokens=12, ignore_eos=True)),
            (make_prompt(7, seed=3), GenerationParams(max_tokens=4, ignore_eos=True))]
    want = run_alone(binding, rows[2]).result
    generations = [Generation(binding, *spec) for spec in rows]
    scheduler = BatchScheduler(binding, max_batch=8)
    for generation in generations:
        scheduler.add(generation)
    outcomes: list[StepOutcome] = []
    while scheduler.running:
        if generations[2].ahead_ends and not binding.fail_at:  # its last token is in flight, not fed on
            assert scheduler.pipelined_steps > 0
            binding.fail_at = binding.batches + 1
        outcomes += scheduler.step()
    failed = {id(o.generation) for o in outcomes if o.error is not None}
    assert failed == {id(generations[0]), id(generations[1])}
    assert want is not None and generations[2].result is not None
    assert generations[2].result.token_ids == want.token_ids
