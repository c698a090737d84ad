"""`LocalEngine`: the `ServeEngine` over one loaded model. One worker thread owns MLX; requests
wait in a FIFO queue; each generation streams its events back to the asyncio side."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxkv_inference import GenerationParams, MlxAutoregressiveBinding, SamplingParams, TextDelta
from mlxkv_inference.engine.cached_generation import CachedGenerator
from mlxkv_inference.engine.generate import Generation
from mlxkv_inference.prompt_cache import TieredPromptCache
from mlxkv_inference.tokenizer.chat import encode_chat
from mlxkv_serve import Delta, Finished, GenerateRequest, PromptTooLongError, TokenLogprob

log = logging.getLogger(__name__)
KEEP_STATES = 1000


class _Handle:
    """The asyncio side of one generation: events arrive from the worker thread."""

    def __init__(self, generation_id: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop) -> None:
        self.generation_id = generation_id
        self.prompt_tokens = prompt_tokens
        self._loop = loop
        self._events: asyncio.Queue[Delta | Finished] = asyncio.Queue()
        self.cancelled = threading.Event()

    def push(self, event: Delta | Finished) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()

    async def events(self) -> AsyncIterator[Delta | Finished]:
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, Finished):
                return

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass(slots=True)
class _Job:
    handle: _Handle
    prompt: list[int]
    history_end: int | None
    params: GenerationParams
    top_logprobs: int | None
    submitted: float = field(default_factory=time.perf_counter)


class LocalEngine:
    def __init__(self, binding: MlxAutoregressiveBinding, tiers: TieredPromptCache | None, *, context_length: int | None = None) -> None:
        self.binding = binding
        self.tiers = tiers
        self.context_length = context_length or int(binding.config.get("max_position_embeddings") or 4096)
        self._generator = CachedGenerator(binding, tiers)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._states: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name="mlxkv-engine", daemon=True)
        self._worker.start()

    @property
    def model_id(self) -> str:
        return self.binding.model_id

    # -- ServeEngine ------------------------------------------------------------------------
    def submit(self, request: GenerateRequest) -> _Handle:
        prompt, history_end = self._encode(request)
        if len(prompt) + request.max_tokens > self.context_length:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens and {request.max_tokens} more were requested; "
                f"the model's context is {self.context_length} tokens"
            )
        s = request.sampling
        sampling = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias), seed=s.seed,
        )
        params = GenerationParams(max_tokens=request.max_tokens, sampling=sampling, stop=request.stop)
        handle = _Handle(uuid.uuid4().hex[:24], len(prompt), asyncio.get_running_loop())
        job = _Job(handle, prompt, history_end, params, request.top_logprobs)
        self._remember(handle.generation_id, {"id": handle.generation_id, "status": "queued", "created": time.time(),
                                              "prompt_tokens": len(prompt)})
        self._queue.put(job)
        return handle

    def cache_stats(self) -> Mapping[str, int | float]:
        if self.tiers is None:
            return {}
        stats = self.tiers.stats()
        return {name: getattr(stats, name) for name in stats.__dataclass_fields__}

    def flush(self, timeout: float) -> bool:
        return self.tiers.flush(timeout) if self.tiers is not None else True

    def generation_state(self, generation_id: str) -> Mapping[str, object] | None:
        with self._lock:
            state = self._states.get(generation_id)
            return dict(state) if state is not None else None

    def close(self, timeout: float) -> None:
        """Cancel what waits in the queue, let the running generation end, flush the cache."""
        waiting: list[_Job | None] = []
        while True:
            try:
                waiting.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for job in waiting:
            if job is not None:
                job.handle.cancel()
                self._queue.put(job)  # the worker reports each one cancelled, in order
        self._queue.put(None)
        self._worker.join(timeout)
        if self.tiers is not None and not self.tiers.close(timeout):
            log.warning("prompt cache writes did not finish within %.0f s", timeout)

    # -- worker -----------------------------------------------------------------------------
    def _encode(self, request: GenerateRequest) -> tuple[list[int], int | None]:
        tokenizer = self.binding.tokenizer
        if request.messages is not None:
            chat = encode_chat(tokenizer, [{"role": m.role, "content": m.content} for m in request.messages])
            return chat.tokens, chat.history_end
        if request.prompt is not None:
            return tokenizer.encode(request.prompt), None
        assert request.prompt_tokens is not None
        bad = [t for t in request.prompt_tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})")
        return list(request.prompt_tokens), None

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._serve(job)
            except Exception as e:  # noqa: BLE001 - one failed generation must not stop the worker
                log.exception("generation %s failed", job.handle.generation_id)
                self._update(job, status="failed", error=str(e))
                job.handle.push(Finished("cancelled", None, len(job.prompt), 0, 0, 0, job.handle.generation_id, 0.0))
        self.binding.release_thread_resources()

    def _serve(self, job: _Job) -> None:
        handle = job.handle
        if handle.cancelled.is_set():
            self._update(job, status="cancelled")
            handle.push(Finished("cancelled", None, len(job.prompt), 0, 0, 0, handle.generation_id, 0.0))
            return
        self._update(job, status="running")
        generation = self._generator.start(job.prompt, job.params, history_end=job.history_end)
        first: float | None = None
        for delta in generation:
            if first is None:
                first = time.perf_counter() - job.submitted  # queueing included, as a client sees it
            if handle.cancelled.is_set():
                generation.cancel()
            final = generation.result is not None  # the held-back tail, after the last token
            logprobs = () if final or job.top_logprobs is None else (self._logprob(delta, job.top_logprobs),)
            if delta.text or logprobs:
                handle.push(Delta(delta.text, logprobs))
        self._generator.settle(generation)
        result = generation.result
        assert result is not None
        self._update(job, status=result.finish_reason if result.finish_reason == "cancelled" else "finished",
                     finish_reason=result.finish_reason, completion_tokens=result.generated_tokens,
                     cached_tokens=result.cached_tokens, seed=result.seed)
        handle.push(Finished(result.finish_reason, generation.stop_string, result.prompt_tokens, result.generated_tokens,
                             result.cached_tokens, result.seed, handle.generation_id, first or 0.0))

    def _logprob(self, delta: TextDelta, top: int) -> TokenLogprob:
        tokenizer = self.binding.tokenizer
        lp = delta.step.logprobs
        token = delta.step.token
        chosen = _float(lp[token])
        alternatives: list[tuple[str, float, tuple[int, ...]]] = []
        if top > 0:
            for i in _top_ids(lp, top):
                text = tokenizer.decode([i])
                alternatives.append((text, _float(lp[i]), tuple(text.encode())))
        text = tokenizer.decode([token])
        return TokenLogprob(text, chosen, tuple(text.encode()), tuple(alternatives))

    def _remember(self, generation_id: str, state: dict[str, Any]) -> None:
        with self._lock:
            self._states[generation_id] = state
            while len(self._states) > KEEP_STATES:
                self._states.popitem(last=False)

    def _update(self, job: _Job, **changes: Any) -> None:
        with self._lock:
            self._states.get(job.handle.generation_id, {}).update(changes)


def _float(value: mx.array) -> float:
    out = value.item()
    assert isinstance(out, float)
    return out


def _top_ids(logprobs: mx.array, k: int) -> list[int]:
    ids = mx.argsort(-logprobs)[:k].tolist()
    return [int(i) for i in ids]  # type: ignore[union-attr, arg-type]
