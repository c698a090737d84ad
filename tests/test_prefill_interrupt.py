"""A prefill chunk stopped between layers for a request that just arrived: nothing of it is lost or
changed, the newcomer gets its first token before the long prompt's chunk goes on, and every
sequence's tokens stay those of running alone."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, SamplingParams
from mlxkv_inference.binding import Fed, Interrupt, evaluate_layers
from mlxkv_inference.scheduler.decode_step import STEP_MAX_ROWS
from mlxkv_inference.scheduler.batch import BatchScheduler
from mlxkv_serve import Delta, Finished, GenerateRequest, Sampling
from tests.bindings import GatedBinding
from tests.factories import make_prompt, make_tiny_binding


class Asked:
    """An interrupt that says stop from its `stop_at`-th question on (1-based; 0: never)."""

    def __init__(self, stop_at: int = 0) -> None:
        self.stop_at = stop_at
        self.asked = 0

    def __call__(self) -> bool:
        self.asked += 1
        return 0 < self.stop_at <= self.asked


class Newcomer:
    """A scheduler's arrival: a request of `tokens` prompt tokens waits from the `at`-th question
    on (1-based; 0: none ever)."""

    def __init__(self, tokens: int = 0, at: int = 0) -> None:
        self.tokens, self.at, self.asked = tokens, at, 0

    def __call__(self) -> int | None:
        self.asked += 1
        return self.tokens if 0 < self.at <= self.asked else None


def states(caches: Sequence[Any]) -> list[mx.array]:
    """Every plain cache's keys and values up to its offset."""
    return [a for c in caches for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])]


def tiny(**overrides: Any) -> MlxAutoregressiveBinding:
    """The server's native path on a 4-layer tiny llama: a stop can fall between its layers."""
    return make_tiny_binding("llama", native=True, num_hidden_layers=4, **overrides)


def one_prompt(prompt: list[int], params: GenerationParams, prefill_step_s: float = 0.0, prefill_budget: int = 64,
               **generation: Any) -> tuple[MlxAutoregressiveBinding, Generation, BatchScheduler]:
    """A scheduler (64 prompt tokens a step) running one generation of `prompt` on `tiny()`."""
    binding = tiny()
    started = Generation(binding, prompt, params, **generation)
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=prefill_budget, prefill_step_s=prefill_step_s)
    scheduler.add(started)
    return binding, started, scheduler


@pytest.mark.parametrize("native", [False, True])
def test_a_chunk_stopped_between_layers_evaluates_later_to_the_uninterrupted_caches(native: bool) -> None:
    binding = make_tiny_binding("llama", native=native, num_hidden_layers=4)
    prompt = make_prompt(40, seed=3)
    reference = binding.make_cache()
    assert binding.prefill(prompt, reference, chunk_size=16) == Fed(40, 0)

    never = Asked()
    caches = binding.make_cache()
    assert binding.prefill(prompt, caches, chunk_size=16, interrupt=never) == Fed(40, 0)
    assert never.asked == 3 * (len(caches) - 1)  # between the layers of each of the three chunks, not after the last

    stop = Asked(stop_at=5)  # the second chunk's second question: after its layer 1 of 4
    caches = binding.make_cache()
    assert binding.prefill(prompt, caches, chunk_size=16, interrupt=stop) == Fed(32, 16, 2)
    always = Asked(stop_at=1)
    assert evaluate_layers(caches, always, 2) == 3  # stopped at once, yet one more layer: calls progress
    assert evaluate_layers(caches, always, 3) == 4 == len(caches)
    assert binding.prefill(prompt[32:], caches, chunk_size=16) == Fed(8, 0)
    assert all(mx.array_equal(a, b).item() for a, b in zip(states(caches), states(reference), strict=True))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=7)])
def test_an_arrival_stops_the_long_chunk_and_takes_its_first_token_before_the_chunk_goes_on(
        sampling: SamplingParams) -> None:
    binding = tiny()
    params = GenerationParams(max_tokens=5, prefill_chunk=64, ignore_eos=True, sampling=sampling)
    long_prompt, short_prompt = make_prompt(200, seed=1), make_prompt(6, seed=2)
    long = Generation(binding, long_prompt, params)
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=64)
    scheduler.add(long)
    scheduler.step(Newcomer(199, at=1))  # as long as the long prompt's rest: it would go after it, no stop
    assert long.unevaluated == 0 and long.prefill_left == 199 - 64
    left = long.prefill_left
    assert scheduler.step(Newcomer(6, at=2)) == []  # arrives during the chunk's second layer
    assert long.prefill_left == left - 64 and long.unevaluated == 64 and long.prefilling

    short = Generation(binding, short_prompt, params)
    scheduler.add(short)
    outcomes = {id(o.generation): o for o in scheduler.step(Newcomer())}
    assert [d.step.step for d in outcomes[id(short)].deltas if d.step is not None] == [0]  # its first token, while the long chunk waits
    assert id(long) not in outcomes and long.unevaluated == 64

    scheduler.step(Newcomer())
    assert long.unevaluated == 0 and long.prefill_left == left - 64  # finished: the step's 64 tokens
    while scheduler.running:
        scheduler.step(Newcomer())
    assert long.result is not None and short.result is not None
    assert (long.result.token_ids, short.result.token_ids) == tuple(
        Generation(binding, prompt, params).run().token_ids for prompt in (long_prompt, short_prompt))


def test_a_long_prompts_last_chunk_is_a_turn_an_arrival_can_stop_not_a_decode_step() -> None:
    """A prompt fed in turns does not ride its last chunk in the decode step (`Generation.join`),
    where nothing could stop it: a request arriving during it stops it between layers, and gets
    its first token before the chunk goes on."""
    params = GenerationParams(max_tokens=3, prefill_chunk=64, ignore_eos=True)
    long_prompt, short_prompt = make_prompt(100, seed=6), make_prompt(3, seed=7)
    binding, long, scheduler = one_prompt(long_prompt, params)
    scheduler.step(Newcomer())
    assert long.prefill_left == 99 - 64  # the rest would fit a decode step's rows
    assert scheduler.step(Newcomer(2, at=1)) == []  # arrives during the last chunk's first layer
    assert long.prefill_left == 0 and long.unevaluated == 99 - 64 and long.prefilling

    short = Generation(binding, short_prompt, params)
    scheduler.add(short)
    outcomes = {id(o.generation): o for o in scheduler.step(Newcomer())}
    assert [d.step.step for d in outcomes[id(short)].deltas if d.step is not None] == [0]
    assert long.unevaluated == 99 - 64
    while scheduler.running:
        scheduler.step(Newcomer())
    assert long.result is not None and short.result is not None
    assert (long.result.token_ids, short.result.token_ids) == tuple(
        Generation(binding, prompt, params).run().token_ids for prompt in (long_prompt, short_prompt))


def test_a_prompt_whose_last_chunk_was_stopped_finishes_it_before_its_first_decode() -> None:
    params = GenerationParams(max_tokens=3, prefill_chunk=128, ignore_eos=True)
    prompt = make_prompt(STEP_MAX_ROWS + 30, seed=5)  # too long to ride in a decode step (`Generation.join`)
    binding, generation, scheduler = one_prompt(prompt, params, prefill_budget=128)
    assert scheduler.step(Newcomer(5, at=1)) == []
    assert generation.prefill_left == 0 and generation.unevaluated == len(prompt) - 1 and generation.prefilling
    assert not generation.needs_step
    while scheduler.running:
        scheduler.step(Newcomer())
    assert generation.result is not None
    assert generation.result.token_ids == Generation(binding, prompt, params).run().token_ids


async def first_answers(engine: LocalEngine, binding: GatedBinding, requests: list[GenerateRequest]) -> list[tuple[int, str]]:
    """Each request's (index, text) in the order they finished: the first one prefills (held at
    the gate) while the second is submitted."""
    order: list[tuple[int, str]] = []

    async def run(index: int) -> None:
        text = ""
        async for event in (await engine.submit(requests[index])).events():
            if isinstance(event, Delta):
                text += event.text
            elif isinstance(event, Finished):
                order.append((index, text))
                return

    tasks = [asyncio.create_task(run(0))]
    await asyncio.to_thread(binding.entered.wait, 30)
    tasks.append(asyncio.create_task(run(1)))
    await asyncio.sleep(0)  # it waits in the queue while the long prompt's chunk is held
    binding.gate.set()
    await asyncio.gather(*tasks)
    return order


def test_the_engine_stops_a_long_prompts_chunk_for_a_request_that_arrives() -> None:
    """One chunk of 400 tokens: without the interrupt the short request would wait for all of it
    and for the long prompt's first token (both requests want one token)."""
    requests = [GenerateRequest(max_tokens=1, prompt_tokens=tuple(make_prompt(n, seed=n)), sampling=Sampling(temperature=0))
                for n in (400, 5)]
    alone = LocalEngine(tiny(), None, max_batch=1)
    try:
        expected = [asyncio.run(first_answers_alone(alone, r)) for r in requests]
    finally:
        alone.close(30)
    binding = tiny(binding_class=GatedBinding)
    assert isinstance(binding, GatedBinding)
    engine = LocalEngine(binding, None, max_batch=8)
    try:
        order = asyncio.run(first_answers(engine, binding, requests))
    finally:
        engine.close(30)
    assert order == [(1, expected[1]), (0, expected[0])]


async def first_answers_alone(engine: LocalEngine, request: GenerateRequest) -> str:
    text = ""
    async for event in (await engine.submit(request)).events():
        if isinstance(event, Delta):
            text += event.text
        elif isinstance(event, Finished):
            return text
    raise AssertionError("no answer")


@pytest.mark.parametrize(("first", "second", "stopped"), [(400, 5, True), (30, 400, False)])
def test_only_a_newcomer_with_less_prompt_than_is_left_stops_a_chunk(first: int, second: int, stopped: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    binding = tiny(binding_class=GatedBinding)
    assert isinstance(binding, GatedBinding)
    evaluated: list[bool] = []
    feed = binding.feed

    def recorded(tokens: Sequence[int], caches: list[Any], interrupt: Interrupt | None = None) -> int:
        layer = feed(tokens, caches, interrupt)
        evaluated.append(layer == len(caches))
        return layer

    monkeypatch.setattr(binding, "feed", recorded)
    requests = [GenerateRequest(max_tokens=1, prompt_tokens=tuple(make_prompt(n, seed=n)), sampling=Sampling(temperature=0))
                for n in (first, second)]
    engine = LocalEngine(binding, None, max_batch=8)
    try:
        asyncio.run(first_answers(engine, binding, requests))
    finally:
        engine.close(30)
    assert evaluated[0] is not stopped  # the first prompt's one chunk, while the second request waited


def test_an_arrival_that_never_starts_cannot_stall_a_prefill() -> None:
    """A caller that keeps answering "a 1-token request waits" without ever starting it: each
    step still evaluates at least one more layer, so the long prompt completes."""
    params = GenerationParams(max_tokens=2, prefill_chunk=64, ignore_eos=True)
    prompt = make_prompt(150, seed=9)
    binding, generation, scheduler = one_prompt(prompt, params)
    for _ in range(60):
        if not scheduler.running:
            break
        scheduler.step(Newcomer(1, at=1))
    assert generation.result is not None
    assert generation.result.token_ids == Generation(binding, prompt, params).run().token_ids


@pytest.mark.parametrize(("tokens", "stops"), [(100_000, False), (3, True)])
def test_with_timed_steps_only_a_newcomer_estimated_sooner_stops_a_chunk(tokens: int, stops: bool) -> None:
    """The server's timed steps: before any chunk was timed the estimates come from the step
    costs, for the newcomer too (a newcomer estimated at 0 s stopped every chunk)."""
    binding, generation, scheduler = one_prompt(make_prompt(400, seed=8), GenerationParams(max_tokens=2, prefill_chunk=64),
                                                prefill_step_s=0.05)
    binding.verifies_positions()  # the step costs the estimates start from
    scheduler.step(Newcomer(tokens, at=1))
    assert (generation.unevaluated > 0) is stops


def test_a_snapshot_point_reached_by_a_stopped_chunk_is_taken_once_the_chunk_is_evaluated() -> None:
    """Taking it at once would evaluate the rest of the chunk in the step the newcomer waits for."""
    params = GenerationParams(max_tokens=2, prefill_chunk=64, ignore_eos=True)
    prompt = make_prompt(STEP_MAX_ROWS + 30, seed=4)  # too long to ride in a decode step whole: the first turn prefills
    taken: list[tuple[int, list[mx.array]]] = []
    binding, generation, scheduler = one_prompt(
        prompt, params, snapshot_at=[40], on_snapshot=lambda tokens, caches: taken.append((len(tokens), states(caches))))
    scheduler.step(Newcomer(5, at=1))
    assert generation.unevaluated == 40 and taken == []
    scheduler.step(Newcomer())
    assert [n for n, _ in taken] == [40]
    reference = binding.make_cache()
    binding.prefill(prompt[:40], reference)
    assert all(mx.array_equal(a, b).item() for a, b in zip(taken[0][1], states(reference), strict=True))
