"""The worker thread, which owns MLX: it admits waiting jobs into the batch (the library's
`Admission` decides which and when), starts them (from a durable checkpoint where there is one),
steps the scheduler and hands each step's text to `Answers`."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.generation.results import CheckpointState, ResumePoint
from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.prompt_cache import ColdRestored
from mlxkv_inference.scheduler.admission import Admission
from mlxkv_inference.scheduler.batch import BatchScheduler
from mlxkv_state.header import GenerationCheckpoint

from mlxkv.engine.answers import Answers
from mlxkv.engine.checkpoints import CheckpointStore
from mlxkv.engine.jobs import Active, GenerationStatus, Job, JobQueue, StatusBook
from mlxkv.engine.logprobs import LogprobTrail
from mlxkv.engine.reasoning import AnswerStream, answer_splitter
from mlxkv.engine.tool_calls import ToolAnswer
from mlxkv.progress import PrefillLog


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """Where a generation's checkpoints go (`store` None: nowhere), every how many tokens, and
    what writes one (the engine's `_save_checkpoint`)."""

    store: CheckpointStore | None
    every: int
    save: Callable[[Job, CheckpointState], None]


class Worker:
    def __init__(self, binding: MlxAutoregressiveBinding, jobs: JobQueue, scheduler: BatchScheduler, admission: Admission[Job],
                 generator: CachedGenerator, answers: Answers, statuses: StatusBook, checkpointing: Checkpointing) -> None:
        self._binding = binding
        self._jobs = jobs
        self.scheduler = scheduler
        self._admission = admission
        self._generator = generator
        self._answers = answers
        self._statuses = statuses
        self._checkpointing = checkpointing
        self._thread = threading.Thread(target=self._run, name="mlxkv-engine", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        """The scheduler loop: admit waiting jobs while the batch has room (a prompt whose prefix
        is on the SSD joins once its read, done off this thread, is in), then step."""
        active: dict[int, Active] = {}
        closing = False
        while active or self._admission.reading or not closing:
            if not closing:
                closing = self._admit_waiting(active)
            for job, read in self._admission.ready():
                self._start(job, read, active)
            if not active:
                self._admission.wait_for_reads()
                continue
            self._step(active, closing)
        held = self._admission.take_held()
        if held is not None:  # waited for KV room when close() came: it ends cancelled
            held.handle.cancel()
            self._start(held, None, active)
        self._binding.release_thread_resources()

    def _admit_waiting(self, active: dict[int, Active]) -> bool:
        """Admit queued jobs while the batch has room; True once `close` has been asked for
        (what is running ends, nothing new is admitted)."""
        while self._admission.has_room(len(active)):
            try:
                job = self._admission.take_held() or self._jobs.get(block=not active and not self._admission.reading)
            except queue.Empty:
                break
            if job is None:
                return True
            if not self._admission.can_admit(job, [e.job for e in active.values()]):
                self._admission.hold(job)  # it goes first once the running generations' KV leaves room
                break
            if self._admission.admit(job):
                self._start(job, None, active)
        return False

    def _step(self, active: dict[int, Active], closing: bool) -> None:
        for entry in active.values():
            if entry.job.cancelled:
                entry.generation.cancel()
        outcomes = self.scheduler.step(lambda: self._admission.arriving(len(active), None if closing else self._jobs.head()))
        # known once a generation's caches hold a token (the shapes, evaluated or not)
        self._admission.learn_kv_bytes_per_token(sum(c.bytes_per_token() for c in e.generation.caches) for e in active.values())
        for outcome in outcomes:
            entry = active[id(outcome.generation)]
            self._answers.push(entry, outcome.deltas, with_logprobs=True)
            if outcome.error is not None:
                del active[id(outcome.generation)]
                self._answers.fail(entry.job, outcome.error)
            elif outcome.finished:
                del active[id(outcome.generation)]
                self._answers.push(entry, outcome.tail, with_logprobs=False)  # its tokens were answered already
                self._answers.finish(entry)

    def _start(self, job: Job, read: ColdRestored | None, active: dict[int, Active]) -> None:
        """Start a job in the scheduler (it ends at once when it was cancelled while it waited, or failed)."""
        if job.cancelled:
            self._answers.end_cancelled(job)
            return
        self._statuses.update(job, GenerationStatus.run)
        try:
            generation = self._generation(job, read)
            splitter = answer_splitter(job.tools, job.history_end is not None, job.think)
            entry = Active(job, generation, AnswerStream(splitter, ToolAnswer(job.tools, job.handle.generation_id)))
            self._answers.push(entry, self.scheduler.add(generation), with_logprobs=True)
        except Exception as e:  # noqa: BLE001 - one failed generation must not stop the worker
            self._answers.fail(job, e)
            return
        active[id(generation)] = entry

    def _generation(self, job: Job, read: ColdRestored | None) -> Generation:
        """A generation continuing this job's checkpoint if one is durable, else a new one."""
        store, every = self._checkpointing.store, self._checkpointing.every
        on_checkpoint = (lambda state: self._checkpointing.save(job, state)) if store is not None else None
        restored = store.load_checkpoint(job.key) if store is not None else None
        job.trail = LogprobTrail(job.top_logprobs) if job.top_logprobs is not None else None
        if restored is not None and _fits(restored.checkpoint, restored.tokens, job.prompt, job.trail):
            checkpoint = restored.checkpoint
            sampling = replace(job.params.sampling, seed=checkpoint.seed)
            if job.trail is not None and checkpoint.logprobs is not None:
                job.trail = LogprobTrail(job.trail.top, (*checkpoint.generated_tokens, checkpoint.pending_token), checkpoint.logprobs)
            self._statuses.update(job, lambda s: s.resume(len(checkpoint.generated_tokens)))
            return self._generator.start(
                job.prompt, replace(job.params, sampling=sampling), job.adapters,
                resume=(restored.caches, ResumePoint(checkpoint.generated_tokens, checkpoint.pending_token, restored.draft)),
                checkpoint_every=every, on_checkpoint=on_checkpoint,
            )
        return self._generator.start(job.prompt, job.params, job.adapters, history_end=job.history_end, read=read,
                                     checkpoint_every=every, on_checkpoint=on_checkpoint,
                                     on_prefill_progress=PrefillLog(f"generation {job.handle.generation_id}"))


def _fits(checkpoint: GenerationCheckpoint, tokens: Sequence[int], prompt: list[int], trail: LogprobTrail | None) -> bool:
    return (checkpoint.original_prompt_tokens == len(prompt) and tuple(tokens) == tuple(prompt) + checkpoint.generated_tokens
            and (trail is None or trail.fits(checkpoint.logprobs)))
