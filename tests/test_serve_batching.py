"""LocalEngine with --max-batch 8: requests that arrive staggered (some while others prefill or
decode, some cancelled mid-way) each get exactly the tokens and logprobs they get alone."""

from __future__ import annotations

import asyncio

import pytest

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import GenerationParams
from mlxkv_serve import Delta, Finished, GenerateRequest, Sampling
from tests.bindings import GatedBinding
from tests.factories import make_prompt, make_tiny_binding

Answer = tuple[list[tuple[str, float]], str, int]  # (token, logprob) per token, finish reason, completion tokens
CANCEL_AFTER = {2: 3, 4: 4}  # request index -> cancelled after this many deltas
LONG = 300  # the cancelled requests' max_tokens: far more than they get to before the cancel lands


def requests() -> list[GenerateRequest]:
    return [
        GenerateRequest(max_tokens=LONG if i in CANCEL_AFTER else 6 + 2 * i, prompt_tokens=tuple(make_prompt(5 + 7 * i, seed=20 + i)), top_logprobs=0,
                        sampling=Sampling(temperature=0) if i % 2 else Sampling(temperature=0.9, top_p=0.9, seed=100 + i))
        for i in range(8)
    ]


async def answer(engine: LocalEngine, request: GenerateRequest, cancel_after: int | None = None,
                 first: asyncio.Event | None = None) -> Answer:
    handle = engine.submit(request)
    tokens: list[tuple[str, float]] = []
    async for event in handle.events():
        if isinstance(event, Delta):
            tokens.extend((lp.token, lp.logprob) for lp in event.logprobs)
            if first is not None:
                first.set()
            if cancel_after is not None and len(tokens) >= cancel_after:
                handle.cancel()
        elif isinstance(event, Finished):
            return tokens, event.finish_reason, event.completion_tokens
    raise AssertionError(f"request failed: {event}")


async def staggered(engine: LocalEngine, binding: GatedBinding) -> list[Answer]:
    """Three requests, three more queued while the first prefills, two after the first answers."""
    reqs = requests()
    first = asyncio.Event()
    tasks = [asyncio.create_task(answer(engine, reqs[0], first=first))]
    tasks += [asyncio.create_task(answer(engine, reqs[i], CANCEL_AFTER.get(i))) for i in (1, 2)]
    await asyncio.to_thread(binding.entered.wait, 30)
    tasks += [asyncio.create_task(answer(engine, reqs[i], CANCEL_AFTER.get(i))) for i in (3, 4, 5)]
    await asyncio.sleep(0)  # let them submit while the worker is held in the first prefill
    binding.gate.set()
    await first.wait()
    tasks += [asyncio.create_task(answer(engine, reqs[i], CANCEL_AFTER.get(i))) for i in (6, 7)]
    return list(await asyncio.gather(*tasks))


async def one_at_a_time(engine: LocalEngine) -> list[Answer]:
    return [await answer(engine, request) for request in requests()]


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_staggered_requests_in_one_batch_answer_as_they_do_alone(kind: str) -> None:
    base = GenerationParams(prefill_chunk=8)
    alone_engine = LocalEngine(make_tiny_binding(kind, seed=2), None, base_params=base, max_batch=1)
    try:
        expected = asyncio.run(one_at_a_time(alone_engine))
    finally:
        alone_engine.close(30)
    binding = make_tiny_binding(kind, seed=2, binding_class=GatedBinding)
    assert isinstance(binding, GatedBinding)
    engine = LocalEngine(binding, None, base_params=base, max_batch=8, max_queue=8)
    try:
        got = asyncio.run(staggered(engine, binding))
        batched = engine.batched_steps
    finally:
        engine.close(30)
    for index, (answer_, reference) in enumerate(zip(got, expected)):
        if index in CANCEL_AFTER:
            tokens, reason, _ = answer_
            assert len(reference[0]) > 80  # alone it runs far past the cancel
            assert reason == "cancelled" and tokens == reference[0][: len(tokens)] and len(tokens) < len(reference[0])
        else:
            assert answer_ == reference
    assert (batched > 0) == (kind == "llama")  # qwen3_next's recurrent layers decode a graph per row
