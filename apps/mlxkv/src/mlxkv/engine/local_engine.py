"""`LocalEngine`: the `ServeEngine` over one loaded model. One worker thread owns MLX; requests
wait in a bounded FIFO queue; each generation streams its events back to the asyncio side.

    preparation.py   a request as the worker runs it (prompt, max_tokens clamp, sampling)
    jobs.py          the handle, the job, its status, the queue it waits in
    worker.py        the worker loop; admission is the library's (`mlxkv_inference.scheduler.admission`)
    answers.py       the stream hand-off: deltas, logprobs, think/answer split, the end
    health.py        cache stats, health, flush
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict, Unpack

from mlxkv_inference import GenerationParams, MlxAutoregressiveBinding
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.generation.results import CheckpointState
from mlxkv_inference.prompt_cache import TieredPromptCache
from mlxkv_inference.scheduler.admission import Admission
from mlxkv_inference.scheduler.batch import DEFAULT_MAX_BATCH, BatchScheduler
from mlxkv_serve import FlushResult, GenerateRequest, QueueFullError
from mlxkv_serve.engine import CachedPrefix
from mlxkv_ssd_cache import KvIdentity
from mlxkv_state.header import GenerationCheckpoint

from mlxkv.engine.answers import Answers
from mlxkv.engine.checkpoints import CheckpointStore, CheckpointWriter
from mlxkv.engine.health import CacheReport
from mlxkv.engine.jobs import GenerationStatus, Handle, Job, JobQueue, StatusBook
from mlxkv.engine.preparation import RequestPreparer
from mlxkv.engine.adapters import AdapterRegistry
from mlxkv.engine.cache_lookup import held_prefix
from mlxkv.engine.remote_tier import RemoteStatus
from mlxkv.engine.worker import Checkpointing, Worker

DEFAULT_MAX_QUEUE = 16
RETRY_AFTER_S = 1  # a hint only: the queue drains as running generations end


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How one engine runs its requests (see `LocalEngine`)."""

    context_length: int | None = None  # None: the model config's max_position_embeddings (else 4096)
    checkpoint_every: int = 0
    base_params: GenerationParams = GenerationParams()
    max_queue: int = DEFAULT_MAX_QUEUE
    max_batch: int = DEFAULT_MAX_BATCH
    max_batch_kv_bytes: int = 0
    prefill_step_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max queue={self.max_queue} must be >= 1")
        if self.max_batch_kv_bytes < 0:
            raise ValueError(f"max batch KV bytes={self.max_batch_kv_bytes} must be >= 0 (0: no limit)")


class EngineKeywords(TypedDict, total=False):
    """`EngineOptions`' fields as `LocalEngine`'s keywords (mypy checks each call's names and types)."""

    context_length: int | None
    checkpoint_every: int
    base_params: GenerationParams
    max_queue: int
    max_batch: int
    max_batch_kv_bytes: int
    prefill_step_s: float


class LocalEngine:
    def __init__(self, binding: MlxAutoregressiveBinding, tiers: TieredPromptCache | None, *, ssd: CheckpointStore | None = None,
                 draft: MlxAutoregressiveBinding | None = None, remote: RemoteStatus | None = None,
                 **options: Unpack[EngineKeywords]) -> None:
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
        self.options = opts = EngineOptions(**options)
        self.binding = binding
        self.tiers = tiers
        self.context_length = opts.context_length or int(binding.config.get("max_position_embeddings") or 4096)
        self._checkpoints = CheckpointWriter(ssd) if ssd is not None and opts.checkpoint_every > 0 else None
        self._report = CacheReport(tiers, ssd, self._checkpoints, remote)
        self._statuses = StatusBook()
        self._jobs = JobQueue()
        identity = KvIdentity(binding.model_id, binding.tokenizer_hash, binding.config_fingerprint)
        self.adapters = AdapterRegistry(binding.adapters, binding.model_id)  # what requests may select
        self._preparer = RequestPreparer(binding.tokenizer, identity, self.context_length, opts.base_params, draft is not None)
        generator = CachedGenerator(binding, tiers, draft)
        self._answers = Answers(binding.tokenizer, self._statuses, generator, self._checkpoints)
        scheduler = BatchScheduler(binding, max_batch=opts.max_batch, prefill_budget=opts.base_params.prefill_chunk,
                                   prefill_step_s=opts.prefill_step_s)
        admission: Admission[Job] = Admission(opts.max_batch, opts.max_batch_kv_bytes, tiers)
        checkpointing = Checkpointing(ssd if self._checkpoints is not None else None, opts.checkpoint_every, self._save_checkpoint)
        self._worker = Worker(binding, self._jobs, scheduler, admission, generator, self._answers, self._statuses, checkpointing)

    @property
    def model_id(self) -> str:
        return self.binding.model_id

    @property
    def base_params(self) -> GenerationParams:
        return self.options.base_params

    @property
    def max_queue(self) -> int:
        return self.options.max_queue

    @property
    def max_batch_kv_bytes(self) -> int:
        return self.options.max_batch_kv_bytes

    # -- ServeEngine ------------------------------------------------------------------------
    async def submit(self, request: GenerateRequest) -> Handle:
        self._check_room()
        # Tokenizing (and compiling a grammar) runs off the event loop: a prompt of megabytes
        # takes seconds, which every other client's stream would wait for (the tokenizer lets
        # go of the GIL while it works).
        adapters = self.adapters.select(request.model, request.adapters)  # an unknown adapter is a 404 before any work
        prepared = await asyncio.to_thread(self._preparer.prepare, request, adapters.ns)
        self._check_room()  # other requests may have queued meanwhile
        prompt = prepared.prompt
        handle = Handle(uuid.uuid4().hex[:24], len(prompt), asyncio.get_running_loop())
        self._statuses.remember(GenerationStatus(handle.generation_id, time.time(), len(prompt)))
        self._jobs.put(Job(handle, prompt, prepared.history_end, prepared.params, request.top_logprobs, prepared.key,
                           prepared.tools, prepared.think, adapters=adapters))
        return handle

    async def count_tokens(self, request: GenerateRequest) -> int:
        return len((await asyncio.to_thread(self._preparer.encode, request, self._preparer.tools(request)))[0])

    async def cached_prefix(self, request: GenerateRequest) -> CachedPrefix:
        """What the prompt cache holds of `request`'s prompt (indexes only)."""
        prompt = (await asyncio.to_thread(self._preparer.encode, request, self._preparer.tools(request)))[0]
        return held_prefix(self.tiers, prompt)

    def adapter_names(self) -> list[str]:
        return [named.name for named in self.adapters.listed()]

    async def add_adapter(self, name: str, path: str, model: str | None = None) -> dict[str, object]:
        """`model` is not read: one model serves every name."""
        # Read off the event loop; nothing is evaluated on this thread (see adapters.files.read_safetensors).
        named = await asyncio.to_thread(self.adapters.add_allowed, name, path)
        adapter = named.adapter
        return {"id": f"{self.model_id}:{named.name}", "name": named.name, "path": str(adapter.path), "kind": adapter.kind,
                "rank": adapter.rank, "layers": len(adapter.layers), "digest": adapter.digest}

    async def remove_adapter(self, name: str, model: str | None = None) -> str | None:
        """`model`: None, or this model's id (`DELETE /v1/adapters/<model id>:NAME`)."""
        if model not in (None, self.model_id) or not self.adapters.remove(name):
            return None
        return f"{self.model_id}:{name}"

    def queue_depth(self) -> int:
        return self._waiting()

    def batch_size(self) -> int:
        return len(self._worker.scheduler.running)

    @property
    def largest_batch(self) -> int:
        """The most generations one step has run."""
        return self._worker.scheduler.largest_batch

    @property
    def batched_steps(self) -> int:
        """Decode steps that ran several generations' rows stacked."""
        return self._worker.scheduler.batched_steps

    def cache_stats(self) -> Mapping[str, int | float]:
        return self._report.cache_stats()

    def release_ram(self, nbytes: int) -> int:
        """Evict about `nbytes` of the RAM prompt tier (memory pressure); the SSD keeps its copies."""
        return self.tiers.ram.release(nbytes) if self.tiers is not None else 0

    def health(self) -> str:
        """"ok", or "degraded" while the shared cache tier does not answer (requests are served cold)."""
        return self._report.health()

    def flush(self, timeout: float) -> FlushResult:
        return self._report.flush(timeout)

    def generation_state(self, generation_id: str) -> Mapping[str, object] | None:
        return self._statuses.get(generation_id)

    def close(self, timeout: float) -> None:
        """Cancel what waits in the queue, let the running generation end, flush the cache."""
        for job in self._jobs.drain():
            if job is not None:
                job.handle.cancel()
                self._jobs.put(job)  # the worker reports each one cancelled, in order
        self._jobs.put(None)
        self._worker.join(timeout)
        self._report.close(timeout)

    # -- helpers ----------------------------------------------------------------------------
    def _check_room(self) -> None:
        waiting = self._waiting()
        if waiting >= self.max_queue:
            raise QueueFullError(f"{waiting} requests are already waiting (the limit is {self.max_queue}); "
                                 "retry later", RETRY_AFTER_S)

    def _waiting(self) -> int:
        """Requests waiting in the queue, after taking out those cancelled while they waited (their
        clients left): they end now, not when the batch has room, and hold no place a live
        request could take."""
        waiting, cancelled = self._jobs.take_cancelled()
        for job in cancelled:
            self._answers.end_cancelled(job)
        return waiting

    def _save_checkpoint(self, job: Job, state: CheckpointState) -> None:
        """Write `job`'s checkpoint behind (on the worker thread, at the generation's request)."""
        assert self._checkpoints is not None
        checkpoint = GenerationCheckpoint(
            cache_ns=job.ns, generated_tokens=state.generated, key=job.key, original_prompt_tokens=len(job.prompt),
            pending_token=state.pending, seed=state.seed, seed_was_explicit=job.params.sampling.seed is not None,
            logprobs=job.trail.for_checkpoint(state) if job.trail is not None else None,
        )
        self._checkpoints.save(job.prompt + list(state.generated), state.caches, checkpoint, state.draft)
        self._statuses.update(job, lambda s: s.checkpoint(len(state.generated)))
