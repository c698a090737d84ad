"""LocalEngine with --max-batch 8: requests that arrive staggered (some while others prefill or
decode, some cancelled mid-way) each get exactly the tokens and logprobs they get alone."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from mlxkv.engine.cache_services import SsdColdTier, open_cold_tier
from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import GenerationParams
from mlxkv_inference.prompt_cache import ColdHit, ColdRestored, TieredPromptCache
from mlxkv_serve import Delta, Finished, GenerateRequest, Sampling
from mlxkv_ssd_cache import SsdCacheStore
from tests.bindings import GatedBinding
from tests.factories import EOS_ID, make_prompt, make_tiny_binding

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
    handle = await engine.submit(request)
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


class GatedColdTier(SsdColdTier):
    """The real SSD tier, whose reads for the prompt cache are handed over only once the test opens the gate."""

    def __init__(self, store: SsdCacheStore) -> None:
        super().__init__(store)
        self.gate = threading.Event()
        self.reads = 0

    def restore_async(self, hit: ColdHit) -> Future[ColdRestored | None]:
        self.reads += 1
        inner = super().restore_async(hit)
        held: Future[ColdRestored | None] = Future()

        def relay() -> None:
            self.gate.wait(60)
            held.set_result(inner.result())

        threading.Thread(target=relay, daemon=True).start()
        return held


async def decode_while_a_read_waits(engine: LocalEngine, cold: GatedColdTier, cached_prompt: list[int]) -> tuple[int, Finished]:
    """A long generation runs; a request whose prefix is on the SSD arrives; the long one keeps
    getting tokens while that read is held. Returns (tokens the long one got meanwhile, the other's end)."""
    long_request = GenerateRequest(max_tokens=400, prompt_tokens=tuple(make_prompt(6, seed=50)),
                                   sampling=Sampling(temperature=0, logit_bias={EOS_ID: -100.0}))
    running = await engine.submit(long_request)
    events = running.events()
    assert isinstance(await anext(events), Delta)
    waiting = await engine.submit(GenerateRequest(max_tokens=4, prompt_tokens=tuple(cached_prompt + [7, 8]), sampling=Sampling(temperature=0)))
    meanwhile = 0
    while meanwhile < 20:  # with the read held, the worker keeps decoding the long generation
        assert isinstance(await anext(events), Delta)
        meanwhile += 1
    assert cold.reads == 1 and engine.batch_size() == 1
    cold.gate.set()
    async for event in waiting.events():
        if isinstance(event, Finished):
            running.cancel()
            return meanwhile, event
    raise AssertionError(f"the request failed: {event}")


def test_a_prompt_cache_read_from_the_ssd_does_not_stop_the_others_decoding(tmp_path: Path) -> None:
    binding = make_tiny_binding("llama")
    cold = GatedColdTier(open_cold_tier(binding, tmp_path, 1 << 30).ssd)
    tiers = TieredPromptCache(1, cold)  # RAM holds nothing: every prefix comes back from the SSD
    engine = LocalEngine(binding, tiers, ssd=cold, max_batch=8)
    cached_prompt = make_prompt(40, seed=51)
    try:
        first = asyncio.run(answer(engine, GenerateRequest(max_tokens=2, prompt_tokens=tuple(cached_prompt), sampling=Sampling(temperature=0))))
        assert first[1] == "length" and engine.flush(30).durable
        meanwhile, finished = asyncio.run(decode_while_a_read_waits(engine, cold, cached_prompt))
    finally:
        engine.close(30)
    assert meanwhile == 20 and finished.finish_reason == "length"
    assert finished.cached_tokens >= len(cached_prompt) - 1 and tiers.stats().ssd_hits == 1


async def four_queued(engine: LocalEngine, binding: GatedBinding, reqs: list[GenerateRequest]) -> list[Answer]:
    tasks = [asyncio.create_task(answer(engine, reqs[0]))]
    await asyncio.to_thread(binding.entered.wait, 30)
    tasks += [asyncio.create_task(answer(engine, r)) for r in reqs[1:]]
    await asyncio.sleep(0)  # all of them wait while the first prefills
    binding.gate.set()
    return list(await asyncio.gather(*tasks))


def test_requests_past_the_kv_budget_wait_for_room_and_answer_as_alone() -> None:
    reqs = [GenerateRequest(max_tokens=10, prompt_tokens=tuple(make_prompt(10, seed=60 + i)), top_logprobs=0,
                            sampling=Sampling(temperature=0)) for i in range(4)]
    alone_engine = LocalEngine(make_tiny_binding("llama", seed=2), None, max_batch=1)
    try:
        expected = [asyncio.run(answer(alone_engine, r)) for r in reqs]
    finally:
        alone_engine.close(30)
    binding = make_tiny_binding("llama", seed=2, binding_class=GatedBinding)
    assert isinstance(binding, GatedBinding)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (keys, values) x KV heads x head dim x float32
    engine = LocalEngine(binding, None, max_batch=8, max_batch_kv_bytes=2 * 20 * per_token)  # room for two of them
    try:
        got = asyncio.run(four_queued(engine, binding, reqs))
        largest = engine.largest_batch
    finally:
        engine.close(30)
    assert got == expected, (got, expected)
    assert largest == 2, largest
