"""A request on its way through the engine: its asyncio handle, the job the worker runs, the
running entry, the status `/v1/generations/{id}` reports, and the queue the jobs wait in."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal

from mlxkv_inference.adapters import AdapterStack
from mlxkv_inference import GenerationParams
from mlxkv_inference.generation.generate import Generation
from mlxkv_serve import Delta, Event

from mlxkv.engine.logprobs import LogprobTrail
from mlxkv.engine.reasoning import AnswerStream, ThinkStart
from mlxkv.engine.tool_calls import ToolUse

KEEP_STATES = 1000

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


class Handle:
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
class Job:
    """A prepared request, as the worker runs it (admission reads `prompt`, `max_tokens`, `cancelled`)."""

    handle: Handle
    prompt: list[int]
    history_end: int | None
    params: GenerationParams
    top_logprobs: int | None
    key: str
    tools: ToolUse = ToolUse(())
    think: ThinkStart = "none"  # a reasoning model's chat answer: its think section is sent apart
    submitted: float = field(default_factory=time.perf_counter)
    trail: LogprobTrail | None = None  # the logprobs sent so far, when the request asked for them
    adapters: AdapterStack = AdapterStack()  # what it runs under: their digests are its cache namespace

    @property
    def ns(self) -> str:
        return self.adapters.ns

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def cancelled(self) -> bool:
        return self.handle.cancelled.is_set()


@dataclass(slots=True)
class Active:
    """A request the scheduler is running."""

    job: Job
    generation: Generation
    answer: AnswerStream  # the think section and tool calls taken out of the text
    first: float | None = None  # seconds from submission to the first text


class StatusBook:
    """The statuses of the last `KEEP_STATES` requests, shared by the event loop and the worker."""

    def __init__(self) -> None:
        self._states: OrderedDict[str, GenerationStatus] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, state: GenerationStatus) -> None:
        with self._lock:
            self._states[state.id] = state
            while len(self._states) > KEEP_STATES:
                self._states.popitem(last=False)

    def update(self, job: Job, change: Callable[[GenerationStatus], None]) -> None:
        with self._lock:
            state = self._states.get(job.handle.generation_id)
            if state is not None:
                change(state)

    def get(self, generation_id: str) -> Mapping[str, object] | None:
        with self._lock:
            state = self._states.get(generation_id)
            return state.as_dict() if state is not None else None


class JobQueue:
    """The FIFO the jobs wait in; None (put by `close`) tells the worker to stop admitting."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue()

    def put(self, job: Job | None) -> None:
        self._queue.put(job)

    def get(self, block: bool) -> Job | None:
        """The next job (raises `queue.Empty` when not `block`ing and none waits)."""
        return self._queue.get(block=block)

    def head(self) -> Job | None:
        with self._queue.mutex:
            return self._queue.queue[0] if self._queue.queue else None

    def take_cancelled(self) -> tuple[int, list[Job]]:
        """(jobs still waiting, those cancelled while they waited, now out of the queue)."""
        with self._queue.mutex:
            queued = self._queue.queue
            cancelled = [job for job in queued if job is not None and job.cancelled]
            for job in cancelled:
                queued.remove(job)
            return sum(1 for job in queued if job is not None), cancelled

    def drain(self) -> list[Job | None]:
        """Everything waiting, taken out in order."""
        waiting: list[Job | None] = []
        while True:
            try:
                waiting.append(self._queue.get_nowait())
            except queue.Empty:
                return waiting
