"""`LocalEngine`: the `ServeEngine` over one loaded model. One worker thread owns MLX; requests
wait in a bounded FIFO queue; each generation streams its events back to the asyncio side."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from mlxkv_inference.adapters import AdapterStack
from mlxkv_inference import GenerationParams, Grammar, MlxAutoregressiveBinding, SamplingParams, compile_grammar
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.generation.generate import CheckpointState, Generation, ResumePoint, TextDelta
from mlxkv_inference.scheduler.batch import DEFAULT_MAX_BATCH, BatchScheduler
from mlxkv_inference.speculative.speculation import SpeculativeParams
from mlxkv_inference.prompt_cache import ColdRestored, TieredPromptCache
from mlxkv_inference.tokenizer.chat import encode_chat, template_takes_tools
from mlxkv_serve import (
    Delta, Event, Failed, Finished, FlushResult, GenerateRequest, PromptTooLongError, QueueFullError, Speculation, TokenLogprob,
)
from mlxkv_ssd_cache import KvIdentity
from mlxkv_state.header import GenerationCheckpoint

from mlxkv.engine.adapters import AdapterRegistry
from mlxkv.engine.checkpoints import CheckpointStore, CheckpointWriter, request_key
from mlxkv.engine.remote_tier import RemoteStatus
from mlxkv.engine.logprobs import LogprobTrail, render
from mlxkv.engine.reasoning import AnswerStream, ThinkSplitter, starts_thinking, think_tags
from mlxkv.engine.tool_calls import ToolAnswer, ToolUse, chat_messages, template_tools, tool_use
from mlxkv.progress import PrefillLog

log = logging.getLogger(__name__)
KEEP_STATES = 1000
DEFAULT_MAX_QUEUE = 16
READ_POLL_S = 0.05  # how long an idle worker waits on SSD reads before it looks at the queue again
RETRY_AFTER_S = 1  # a hint only: the queue drains as running generations end


Status = Literal["queued", "running", "finished", "cancelled", "failed"]


@dataclass(slots=True)
class GenerationStatus:
    """What `/v1/generations/{id}` reports; fields stay None until they are known."""

    id: str
    created: float
    prompt_tokens: int
    status: Status = "queued"
    finish_reason: str | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    seed: int | None = None
    resumed_tokens: int | None = None
    checkpointed_tokens: int | None = None
    error: str | None = None

    def run(self) -> None:
        self.status = "running"

    def cancel(self) -> None:
        self.status = "cancelled"

    def resume(self, resumed_tokens: int) -> None:
        self.resumed_tokens = resumed_tokens

    def checkpoint(self, checkpointed_tokens: int) -> None:
        self.checkpointed_tokens = checkpointed_tokens

    def fail(self, error: str) -> None:
        self.status, self.error = "failed", error

    def finish(self, finish_reason: str, completion_tokens: int, cached_tokens: int, seed: int) -> None:
        self.status = "cancelled" if finish_reason == "cancelled" else "finished"
        self.finish_reason, self.completion_tokens, self.cached_tokens, self.seed = finish_reason, completion_tokens, cached_tokens, seed

    def as_dict(self) -> dict[str, object]:
        return {name: value for name, value in asdict(self).items() if value is not None}


class _Handle:
    """The asyncio side of one generation: events arrive from the worker thread."""

    def __init__(self, generation_id: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop) -> None:
        self.generation_id = generation_id
        self.prompt_tokens = prompt_tokens
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()

    def push(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._events.get()
            yield event
            if not isinstance(event, Delta):
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
    key: str
    tools: ToolUse = ToolUse((), None)
    chat: bool = False  # a templated chat: a reasoning model's think section is sent apart
    submitted: float = field(default_factory=time.perf_counter)
    trail: LogprobTrail | None = None  # the logprobs sent so far, when the request asked for them
    adapters: AdapterStack = AdapterStack()  # what it runs under: their digests are its cache namespace


@dataclass(slots=True)
class _Active:
    """A request the scheduler is running."""

    job: _Job
    generation: Generation
    answer: AnswerStream  # the think section and tool calls taken out of the text
    first: float | None = None  # seconds from submission to the first text


class LocalEngine:
    def __init__(
        self,
        binding: MlxAutoregressiveBinding,
        tiers: TieredPromptCache | None,
        *,
        context_length: int | None = None,
        ssd: CheckpointStore | None = None,
        checkpoint_every: int = 0,
        base_params: GenerationParams = GenerationParams(),
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_batch_kv_bytes: int = 0,
        draft: MlxAutoregressiveBinding | None = None,
        prefill_step_s: float = 0.0,
        remote: RemoteStatus | None = None,
    ) -> None:
        """`ssd` is the tiers' SSD store (for its stats and for checkpoints); with
        `checkpoint_every` > 0 a generation's state is written behind every so many tokens, and an
        identical request after a crash continues from it. `base_params` gives what a request does
        not (prefill chunk, compiled decode); up to `max_batch` generations run together (each
        token what it would be alone), as long as their KV (prompt and max_tokens, at the model's
        bytes a token) fits in `max_batch_kv_bytes` (0: no limit; a request alone always runs),
        and at most `max_queue` requests wait behind them. `draft` is the draft model of requests
        speculating in mode "draft" (base_params.speculative holds the server's defaults).
        `prefill_step_s` bounds a step's prefill time (see `BatchScheduler`). `remote`: the shared
        tier under the SSD, for /health and the cache stats."""
        if max_queue < 1:
            raise ValueError(f"max queue={max_queue} must be >= 1")
        if max_batch_kv_bytes < 0:
            raise ValueError(f"max batch KV bytes={max_batch_kv_bytes} must be >= 0 (0: no limit)")
        self.max_batch_kv_bytes = max_batch_kv_bytes
        self._kv_bytes_per_token = 0  # learned from the running caches after a step (see `_step`)
        self._held: _Job | None = None  # admitted next, once the running generations' KV leaves room
        self.binding = binding
        self.base_params = base_params
        self.max_queue = max_queue
        self.tiers = tiers
        self._identity = KvIdentity(binding.model_id, binding.tokenizer_hash, binding.config_fingerprint)
        self._checkpoints = CheckpointWriter(ssd) if ssd is not None and checkpoint_every > 0 else None
        self._ssd = ssd
        self._remote = remote
        self._checkpoint_every = checkpoint_every
        self.context_length = context_length or int(binding.config.get("max_position_embeddings") or 4096)
        self._generator = CachedGenerator(binding, tiers, draft)
        self.adapters = AdapterRegistry(binding.adapters, binding.model_id)  # what requests may select
        self._think = think_tags(binding.tokenizer)  # None: the model does not think
        self._scheduler = BatchScheduler(binding, max_batch=max_batch, prefill_budget=base_params.prefill_chunk,
                                         prefill_step_s=prefill_step_s)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._states: OrderedDict[str, GenerationStatus] = OrderedDict()
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name="mlxkv-engine", daemon=True)
        self._worker.start()

    @property
    def model_id(self) -> str:
        return self.binding.model_id

    # -- ServeEngine ------------------------------------------------------------------------
    async def submit(self, request: GenerateRequest) -> _Handle:
        self._check_room()
        # Tokenizing (and compiling a grammar) runs off the event loop: a prompt of megabytes
        # takes seconds, which every other client's stream would wait for (the tokenizer lets
        # go of the GIL while it works).
        adapters = self.adapters.select(request.model, request.adapters)  # an unknown adapter is a 404 before any work
        prompt, history_end, params, key, tools = await asyncio.to_thread(self._prepare, request, adapters.ns)
        self._check_room()  # other requests may have queued meanwhile
        handle = _Handle(uuid.uuid4().hex[:24], len(prompt), asyncio.get_running_loop())
        self._remember(GenerationStatus(handle.generation_id, time.time(), len(prompt)))
        self._queue.put(_Job(handle, prompt, history_end, params, request.top_logprobs, key, tools, request.messages is not None,
                             adapters=adapters))
        return handle

    def _check_room(self) -> None:
        waiting = self._waiting()
        if waiting >= self.max_queue:
            raise QueueFullError(f"{waiting} requests are already waiting (the limit is {self.max_queue}); "
                                 "retry later", RETRY_AFTER_S)

    def _prepare(self, request: GenerateRequest, ns: str = "") -> tuple[list[int], int | None, GenerationParams, str, ToolUse]:
        """(prompt, its history's end, params, request key, tools): the request as the worker runs
        it; raises what `submit` documents for a bad one."""
        tools = tool_use(request)
        prompt, history_end = self._encode(request, tools)
        if len(prompt) >= self.context_length:
            raise PromptTooLongError(f"the prompt has {len(prompt)} tokens; the model's context is {self.context_length} "
                                     "tokens (the prompt must leave room for at least one token of answer)")
        # Agents ask for more than any local context holds (Claude Code: 32,000 or 128,000): the
        # answer gets what fits, and says "length" if it runs out, instead of a refusal.
        max_tokens = min(request.max_tokens, self.context_length - len(prompt))
        s = request.sampling
        sampling = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias), seed=s.seed,
        )
        grammar = tools.grammar or (Grammar(request.constraint.kind, request.constraint.source) if request.constraint else None)
        if grammar is not None:
            compile_grammar(grammar, self.binding.tokenizer)  # a grammar that does not compile is the caller's 400
        params = replace(self.base_params, max_tokens=max_tokens, sampling=sampling, stop=request.stop, grammar=grammar,
                         speculative=self._speculation(request.speculative))
        return prompt, history_end, params, request_key(self._identity, ns, prompt, params, request.top_logprobs), tools

    def _speculation(self, asked: Speculation) -> SpeculativeParams:
        """The request's `speculative` field over the server's defaults (a 400 when it asks for a
        draft model the server has none of)."""
        default = self.base_params.speculative
        mode = asked.mode or default.mode
        if mode == "draft" and self._generator.draft is None:
            raise ValueError("speculative mode 'draft' needs a draft model; start the server with --draft-model or --draft-layers")
        return replace(default, mode=mode, num_draft_tokens=asked.num_draft_tokens or default.num_draft_tokens)

    async def count_tokens(self, request: GenerateRequest) -> int:
        return len((await asyncio.to_thread(self._encode, request, tool_use(request)))[0])

    def queue_depth(self) -> int:
        return self._waiting()

    def _waiting(self) -> int:
        """Requests waiting in the queue, after taking out those cancelled while they waited (their
        clients left): they end now, not when the batch has room, and hold no place a live
        request could take."""
        with self._queue.mutex:
            queued = self._queue.queue
            cancelled = [job for job in queued if job is not None and job.handle.cancelled.is_set()]
            for job in cancelled:
                queued.remove(job)
            waiting = sum(1 for job in queued if job is not None)
        for job in cancelled:
            self._end_cancelled(job)
        return waiting

    def _end_cancelled(self, job: _Job) -> None:
        """A request cancelled before it started: its status and its stream's end."""
        self._update(job, GenerationStatus.cancel)
        job.handle.push(Finished("cancelled", None, len(job.prompt), 0, 0, 0, job.handle.generation_id, 0.0))

    def adapter_names(self) -> list[str]:
        return [named.name for named in self.adapters.listed()]

    async def add_adapter(self, name: str, path: str) -> dict[str, object]:
        # Read off the event loop; nothing is evaluated on this thread (see adapters.files.read_safetensors).
        named = await asyncio.to_thread(self.adapters.add_allowed, name, path)
        adapter = named.adapter
        return {"id": f"{self.model_id}:{named.name}", "name": named.name, "path": str(adapter.path), "kind": adapter.kind,
                "rank": adapter.rank, "layers": len(adapter.layers), "digest": adapter.digest}

    def remove_adapter(self, name: str) -> bool:
        return self.adapters.remove(name)

    def batch_size(self) -> int:
        return len(self._scheduler.running)

    @property
    def largest_batch(self) -> int:
        """The most generations one step has run."""
        return self._scheduler.largest_batch

    @property
    def batched_steps(self) -> int:
        """Decode steps that ran several generations' rows stacked."""
        return self._scheduler.batched_steps

    def cache_stats(self) -> Mapping[str, int | float]:
        out: dict[str, int | float] = {}
        if self.tiers is not None:
            stats = self.tiers.stats()
            out.update({name: getattr(stats, name) for name in stats.__dataclass_fields__})
        if self._ssd is not None:
            ssd = self._ssd.stats()
            out.update({f"ssd_{name}": getattr(ssd, name) for name in ssd.__dataclass_fields__})
        if self._checkpoints is not None:
            out["checkpoints_written"] = self._checkpoints.written
        if self._remote is not None:
            out.update(self._remote.remote_stats())
        return out

    def health(self) -> str:
        """"ok", or "degraded" while the shared cache tier does not answer (requests are served cold)."""
        return self._remote.health() if self._remote is not None else "ok"

    def flush(self, timeout: float) -> FlushResult:
        reports = [w.flush(timeout) for w in (self._checkpoints, self.tiers) if w is not None]
        return FlushResult(all(r.settled for r in reports), sum(r.written for r in reports), sum(r.failed for r in reports))

    def generation_state(self, generation_id: str) -> Mapping[str, object] | None:
        with self._lock:
            state = self._states.get(generation_id)
            return state.as_dict() if state is not None else None

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
        if self._checkpoints is not None and not self._checkpoints.close(timeout).settled:
            log.warning("checkpoint writes did not finish within %.0f s", timeout)
        if self.tiers is not None and not self.tiers.close(timeout).settled:
            log.warning("prompt cache writes did not finish within %.0f s", timeout)

    # -- worker -----------------------------------------------------------------------------
    def _encode(self, request: GenerateRequest, tools: ToolUse) -> tuple[list[int], int | None]:
        tokenizer = self.binding.tokenizer
        if request.messages is not None:
            native = template_takes_tools(tokenizer)
            messages = chat_messages(request.messages, tools.tools, native)
            chat = encode_chat(tokenizer, messages, template_tools(tools.tools) if native and tools.tools else None,
                               request.answer_start)
            return chat.tokens, chat.history_end
        if request.prompt is not None:
            return tokenizer.encode(request.prompt), None
        assert request.prompt_tokens is not None
        bad = [t for t in request.prompt_tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})")
        return list(request.prompt_tokens), None

    def _run(self) -> None:
        """The scheduler loop: admit waiting requests while the batch has room (a prompt whose
        prefix is on the SSD joins once its read, done off this thread, is in), then step."""
        active: dict[int, _Active] = {}
        reading: list[tuple[_Job, Future[ColdRestored | None]]] = []
        closing = False

        def arrived() -> int | None:
            """The prompt tokens of a request the next pass of this loop would start (the next in
            the queue, with room in the batch; else the shortest whose SSD read is in), for a
            step's prefill to give way to it (`BatchScheduler.step`); None when none would."""
            room = not closing and self._held is None and len(active) + len(reading) < self._scheduler.max_batch
            with self._queue.mutex:
                head = self._queue.queue[0] if room and self._queue.queue else None
            if head is not None and not head.handle.cancelled.is_set():
                return len(head.prompt)
            return min((len(job.prompt) for job, read in reading if read.done()), default=None)

        while active or reading or not closing:
            while not closing and len(active) + len(reading) < self._scheduler.max_batch:
                try:
                    job = self._held or self._queue.get(block=not active and not reading)
                except queue.Empty:
                    break
                self._held = None
                if job is not None and (active or reading) and not self._kv_fits(job, [e.job for e in active.values()]
                                                                                 + [j for j, _ in reading]):
                    self._held = job
                    break
                if job is None:
                    closing = True  # close(): what is running ends, nothing new is admitted
                elif (read := self._read_ahead(job)) is not None:
                    reading.append((job, read))
                elif (started := self._admit(job)) is not None:
                    active[id(started.generation)] = started
            for job, read in [r for r in reading if r[1].done()]:
                reading.remove((job, read))
                if (started := self._admit(job, _read_result(read))) is not None:
                    active[id(started.generation)] = started
            if not active:
                wait([read for _, read in reading], READ_POLL_S, FIRST_COMPLETED)
                continue
            self._step(active, arrived)
        if self._held is not None:  # waited for KV room when close() came: it ends cancelled
            self._held.handle.cancel()
            self._admit(self._held)
        self.binding.release_thread_resources()

    def _kv_fits(self, job: _Job, running: list[_Job]) -> bool:
        """Whether `job` joins the running generations within the KV budget (their prompts and
        max_tokens at the model's KV bytes a token)."""
        if not self.max_batch_kv_bytes or not self._kv_bytes_per_token:
            return True
        tokens = sum(len(j.prompt) + j.params.max_tokens for j in [*running, job])
        return tokens * self._kv_bytes_per_token <= self.max_batch_kv_bytes

    def _step(self, active: dict[int, _Active], arrived: Callable[[], int | None]) -> None:
        for entry in active.values():
            if entry.job.handle.cancelled.is_set():
                entry.generation.cancel()
        outcomes = self._scheduler.step(arrived)
        if not self._kv_bytes_per_token:  # known once a generation's caches hold a token (the shapes, evaluated or not)
            self._kv_bytes_per_token = max((sum(c.bytes_per_token() for c in e.generation.caches) for e in active.values()),
                                           default=0)
        for outcome in outcomes:
            entry = active[id(outcome.generation)]
            self._push(entry, outcome.deltas, with_logprobs=True)
            if outcome.error is not None:
                del active[id(outcome.generation)]
                self._fail(entry.job, outcome.error)
            elif outcome.finished:
                del active[id(outcome.generation)]
                self._push(entry, outcome.tail, with_logprobs=False)  # its tokens were answered already
                self._finish(entry)

    def _read_ahead(self, job: _Job) -> Future[ColdRestored | None] | None:
        """Start reading the SSD prefix of a request's prompt, when one is longer than RAM's."""
        if self.tiers is None or job.handle.cancelled.is_set():
            return None
        hit = self.tiers.cold_hit(job.prompt, job.adapters.ns)
        return self.tiers.read_cold(hit) if hit is not None else None

    def _admit(self, job: _Job, read: ColdRestored | None = None) -> _Active | None:
        """Start a request in the scheduler (None when it was cancelled while it waited, or failed)."""
        handle = job.handle
        if handle.cancelled.is_set():
            self._end_cancelled(job)
            return None
        self._update(job, GenerationStatus.run)
        try:
            generation = self._start(job, read)
            thinks = job.chat and self._think is not None
            splitter = ThinkSplitter(thinks, thinks and starts_thinking(self._think, job.prompt))
            entry = _Active(job, generation, AnswerStream(splitter, ToolAnswer(job.tools, handle.generation_id)))
            self._push(entry, self._scheduler.add(generation), with_logprobs=True)
        except Exception as e:  # noqa: BLE001 - one failed generation must not stop the worker
            self._fail(job, e)
            return None
        return entry

    def _push(self, entry: _Active, deltas: Sequence[TextDelta], *, with_logprobs: bool) -> None:
        job = entry.job
        for delta in deltas:
            if entry.first is None:
                entry.first = time.perf_counter() - job.submitted  # queueing included, as a client sees it
            logprobs: tuple[TokenLogprob, ...] = ()
            if job.trail is not None and with_logprobs:
                logprobs = (render(self.binding.tokenizer, *job.trail.next(delta.step)),)
            reasoning, text = entry.answer.feed(delta.text)
            if text or reasoning or logprobs:
                job.handle.push(Delta(text, reasoning, logprobs))

    def _fail(self, job: _Job, error: Exception) -> None:
        log.error("generation %s failed", job.handle.generation_id, exc_info=error)
        self._update(job, lambda s: s.fail(str(error)))
        job.handle.push(Failed(job.handle.generation_id, f"{type(error).__name__}: {error}"))

    def _finish(self, entry: _Active) -> None:
        job, generation, handle = entry.job, entry.generation, entry.job.handle
        self._generator.settle(generation)
        result = generation.result
        assert result is not None
        reasoning, rest, calls = entry.answer.finish()
        if rest or reasoning:
            handle.push(Delta(rest, reasoning))
        if self._checkpoints is not None and result.finish_reason != "cancelled":
            self._checkpoints.remove(job.key)  # finished: nothing left to resume
        # The caches of a resumed generation also hold the tokens generated before the restart:
        # usage counts those apart, so cached tokens never exceed the prompt.
        cached = min(result.cached_tokens, result.prompt_tokens)
        resumed = result.cached_tokens - cached
        self._update(job, lambda s: s.finish(result.finish_reason, result.generated_tokens, cached, result.seed))
        # Calls end the answer only when it ended by itself: cut by max_tokens, it says "length".
        finish_reason = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
        handle.push(Finished(finish_reason, generation.stop_string, result.prompt_tokens,
                             result.generated_tokens, cached, result.seed, handle.generation_id, entry.first or 0.0, resumed, calls,
                             result.draft_tokens, result.accepted_tokens))

    def _start(self, job: _Job, read: ColdRestored | None) -> Generation:
        """A generation continuing this request's checkpoint if one is durable, else a new one."""
        on_checkpoint = (lambda state: self._save_checkpoint(job, state)) if self._checkpoints else None
        restored = self._ssd.load_checkpoint(job.key) if self._checkpoints and self._ssd else None
        job.trail = LogprobTrail(job.top_logprobs) if job.top_logprobs is not None else None
        if restored is not None and _fits(restored.checkpoint, restored.tokens, job.prompt, job.trail):
            checkpoint = restored.checkpoint
            sampling = replace(job.params.sampling, seed=checkpoint.seed)
            if job.trail is not None and checkpoint.logprobs is not None:
                job.trail = LogprobTrail(job.trail.top, (*checkpoint.generated_tokens, checkpoint.pending_token), checkpoint.logprobs)
            self._update(job, lambda s: s.resume(len(checkpoint.generated_tokens)))
            return self._generator.start(
                job.prompt, replace(job.params, sampling=sampling), job.adapters,
                resume=(restored.caches, ResumePoint(checkpoint.generated_tokens, checkpoint.pending_token, restored.draft)),
                checkpoint_every=self._checkpoint_every, on_checkpoint=on_checkpoint,
            )
        return self._generator.start(job.prompt, job.params, job.adapters, history_end=job.history_end, read=read,
                                     checkpoint_every=self._checkpoint_every, on_checkpoint=on_checkpoint,
                                     on_prefill_progress=PrefillLog(f"generation {job.handle.generation_id}"))

    def _save_checkpoint(self, job: _Job, state: CheckpointState) -> None:
        assert self._checkpoints is not None
        checkpoint = GenerationCheckpoint(
            cache_ns=job.adapters.ns, generated_tokens=state.generated, key=job.key, original_prompt_tokens=len(job.prompt),
            pending_token=state.pending, seed=state.seed, seed_was_explicit=job.params.sampling.seed is not None,
            logprobs=job.trail.for_checkpoint(state) if job.trail is not None else None,
        )
        self._checkpoints.save(job.prompt + list(state.generated), state.caches, checkpoint, state.draft)
        self._update(job, lambda s: s.checkpoint(len(state.generated)))

    def _remember(self, state: GenerationStatus) -> None:
        with self._lock:
            self._states[state.id] = state
            while len(self._states) > KEEP_STATES:
                self._states.popitem(last=False)

    def _update(self, job: _Job, change: Callable[[GenerationStatus], None]) -> None:
        with self._lock:
            state = self._states.get(job.handle.generation_id)
            if state is not None:
                change(state)


def _read_result(read: Future[ColdRestored | None]) -> ColdRestored | None:
    error = read.exception()
    if error is not None:  # the read failed: the prompt is served from RAM or prefilled
        log.warning("prompt cache read failed: %s: %s", type(error).__name__, error)
        return None
    return read.result()


def _fits(checkpoint: GenerationCheckpoint, tokens: Sequence[int], prompt: list[int], trail: LogprobTrail | None) -> bool:
    return (checkpoint.original_prompt_tokens == len(prompt) and tuple(tokens) == tuple(prompt) + checkpoint.generated_tokens
            and (trail is None or trail.fits(checkpoint.logprobs)))
