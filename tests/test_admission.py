"""Admission: which waiting request joins the running batch (room, KV budget, the held request,
SSD read-ahead). Model-free: requests are plain records, the cold tier a real SSD store."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from mlxkv.engine.cache_services import SsdColdTier
from mlxkv.engine.jobs import Handle, Job
from mlxkv_inference import GenerationParams
from mlxkv_inference.prompt_cache import TieredPromptCache
from mlxkv_inference.scheduler.admission import Admission, Waiting
from mlxkv_ssd_cache import KvIdentity, SsdCacheStore
from tests.factories import make_plain_caches


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int = 10
    cancelled: bool = False
    ns: str = ""


def request(prompt_tokens: int, max_tokens: int = 10) -> Request:
    return Request(list(range(1, prompt_tokens + 1)), max_tokens)


def test_a_request_alone_always_joins_whatever_its_kv() -> None:
    admission: Admission[Request] = Admission(max_batch=4, max_kv_bytes=100)
    admission.learn_kv_bytes_per_token([1000])
    big = request(50)
    assert admission.can_admit(big, running=[])


def test_kv_budget_holds_a_request_and_gives_it_back_first() -> None:
    admission: Admission[Request] = Admission(max_batch=4, max_kv_bytes=100 * 4)
    admission.learn_kv_bytes_per_token([0, 4, 3])  # the largest running cache's bytes a token
    running = [request(30, 20)]  # 50 tokens
    fits, too_big = request(40, 10), request(41, 10)  # 50 + 50 = 100 tokens fit; 101 do not
    assert admission.can_admit(fits, running)
    assert not admission.can_admit(too_big, running)
    admission.hold(too_big)
    assert admission.arriving(running=1, head=fits) is None  # a held request goes before the queue
    assert admission.take_held() is too_big and admission.take_held() is None


def test_the_budget_is_not_judged_before_a_token_size_is_known() -> None:
    admission: Admission[Request] = Admission(max_batch=4, max_kv_bytes=1)
    admission.learn_kv_bytes_per_token([])
    assert admission.kv_bytes_per_token == 0 and admission.can_admit(request(500), [request(500)])
    admission.learn_kv_bytes_per_token([7])
    admission.learn_kv_bytes_per_token([9])  # the first size learned stays
    assert admission.kv_bytes_per_token == 7 and not admission.can_admit(request(500), [request(500)])


def test_room_counts_running_requests_and_reads_in_flight() -> None:
    admission: Admission[Request] = Admission(max_batch=2)
    assert admission.has_room(1) and not admission.has_room(2)
    assert admission.arriving(running=1, head=request(7)) == 7
    assert admission.arriving(running=2, head=request(7)) is None
    cancelled = request(7)
    cancelled.cancelled = True
    assert admission.arriving(running=0, head=cancelled) is None


def test_without_a_cold_tier_every_admitted_request_starts_now() -> None:
    admission: Admission[Request] = Admission(max_batch=2)
    assert admission.admit(request(5)) and admission.reading == 0 and admission.ready() == []


def test_a_prompt_with_an_ssd_prefix_joins_once_its_read_is_in(tmp_path: Path) -> None:
    store = SsdCacheStore(tmp_path, KvIdentity("model-a", "tok-a", "fp-a"), 1 << 30)
    assert store.store(list(range(1, 13)), make_plain_caches(12))
    tiers = TieredPromptCache(1 << 30, SsdColdTier(store))
    admission: Admission[Request] = Admission(max_batch=2, tiers=tiers)
    cold, other = request(20), Request([99, 98, 97])
    assert not admission.admit(cold) and admission.admit(other)
    assert admission.reading == 1 and not admission.has_room(1)
    admission.wait_for_reads(30)
    [(started, read)] = admission.ready()
    assert started is cold and read is not None and read.tokens == tuple(range(1, 13))
    assert admission.reading == 0 and all(c.offset == 12 for c in read.caches)
    tiers.close(30)
    store.close()


def test_the_engine_job_is_what_admission_waits_on() -> None:
    loop = asyncio.new_event_loop()
    job = Job(Handle("g", 4, loop), [1, 2, 3, 4], None, GenerationParams(max_tokens=6), None, "k")
    waiting: Waiting = job
    admission: Admission[Job] = Admission(max_batch=2, max_kv_bytes=10)
    admission.learn_kv_bytes_per_token([1])
    assert (waiting.max_tokens, waiting.cancelled, admission.arriving(running=0, head=job)) == (6, False, 4)
    assert not admission.can_admit(job, running=[job])  # 20 tokens of KV at a byte each > 10
    job.handle.cancel()
    assert waiting.cancelled and admission.admit(job)
    loop.close()
