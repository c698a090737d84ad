"""`ModelRouter`: several models behind one `ServeEngine`, each request served by its `model`.

Each loaded model is its own engine (a `LocalEngine`, with its own worker thread: MLX on the CPU
runs several threads' graphs at once, each token what it would be alone, measured). Models load on
demand on one loader thread, so a load never holds up the event loop or another model's decoding;
requests for a model being loaded wait for it. At most `max_models` are loaded; the least recently
used idle one that is not pinned makes room, as does one idle for `ttl_s`. Unloading closes the
engine (its write-behind flushed, its RAM tier released); its SSD KV stays for the next load.

    submit -> resolve name -> ready (load: make room -> load) -> memory room for the request -> engine
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from mlxkv_serve import (
    FlushResult, GenerateRequest, GenerationHandle, ModelInfo, ModelUnavailableError, ServeEngine, UnknownModelError,
)

from mlxkv.engine.memory import LIVE, MemoryBudget, plan_kv

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often a load or a request waiting for room looks again
DEFAULT_WAIT_S = 300.0  # the longest a load waits for a busy model to become idle before a 503
CLOSE_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A registered model: `source` is a local path or a Hugging Face id (None: the embedded model)."""

    name: str
    source: str | None

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError(f"model name {self.name!r} is empty")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model's engine with what the memory budget counts: its weights and RAM tier cap, and its
    KV a token. `release` closes the engine (flushing its writes) and what it opened."""

    engine: ServeEngine
    resident_bytes: int
    kv_bytes_per_token: int
    context_length: int
    vocab_size: int
    release: Callable[[float], None]


Loader = Callable[[ModelSpec], LoadedModel]


@dataclass(slots=True)
class _Slot:
    spec: ModelSpec
    pinned: bool
    loaded: LoadedModel | None = None
    loading: Future[LoadedModel] | None = None
    error: str | None = None
    last_used: float = 0.0
    entering: int = 0  # requests between choosing this model and its engine holding them
    entering_kv: int = 0  # the planned KV of those past the budget check
    planned: dict[str, int] = field(default_factory=dict)  # generation id -> planned KV bytes


class ModelRouter:
    """`ServeEngine` and `ModelCatalog` over several models (see the module docstring)."""

    def __init__(self, specs: list[ModelSpec], loader: Loader, *, max_models: int, budget: MemoryBudget,
                 estimate: Callable[[ModelSpec], int], default: str | None = None, pinned: tuple[str, ...] = (),
                 ttl_s: float = 0.0, wait_s: float = DEFAULT_WAIT_S, clock: Callable[[], float] = time.monotonic,
                 discover: Callable[[str], ModelSpec | None] | None = None) -> None:
        """`estimate`: the bytes a model will hold once loaded (weights and RAM tier), before it
        loads. `discover`: a model for a name not registered (a Hugging Face id in the hub cache)."""
        names = [s.name for s in specs]
        if len(specs) < 2 or len(set(names)) != len(names):
            raise ValueError(f"a router serves two or more models with distinct names, not {names}")
        if max_models < 1:
            raise ValueError(f"--max-models={max_models} must be >= 1")
        for name in (*pinned, *([default] if default else [])):
            if name not in names:
                raise ValueError(f"model {name!r} is not registered (registered: {', '.join(names)})")
        if len(pinned) > max_models:
            raise ValueError(f"{len(pinned)} pinned models do not fit in --max-models={max_models}")
        self._slots = {s.name: _Slot(s, s.name in pinned) for s in specs}
        self._loader, self._estimate, self._budget = loader, estimate, budget
        self.max_models, self.default, self.ttl_s, self.wait_s = max_models, default, ttl_s, wait_s
        self._clock, self._discover = clock, discover
        self._lock = threading.RLock()
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="mlxkv-model-load")
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="mlxkv-model-ttl", daemon=True) if ttl_s > 0 else None
        if self._reaper is not None:
            self._reaper.start()

    # -- catalog ----------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.default or next(iter(self._slots))

    def resolve(self, asked: str | None) -> str:
        if asked in self._slots:
            return asked
        if asked and asked.rpartition(":")[0] in self._slots:  # `<model>:ADAPTER`: that model's adapter
            return asked.rpartition(":")[0]
        found = self._discover(asked) if asked and self._discover is not None else None
        if found is not None:
            with self._lock:
                self._slots.setdefault(found.name, _Slot(found, False))
            return found.name
        if self.default is not None:
            return self.default
        raise UnknownModelError(f"the model {asked!r} does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self._slots)}")

    def models(self) -> tuple[ModelInfo, ...]:
        with self._lock:
            return tuple(ModelInfo(s.spec.name, _state(s), s.pinned, s.error) for s in self._slots.values())

    def load_pinned(self) -> None:
        """Load the pinned models now (start-up): they are never unloaded."""
        for slot in self._slots.values():
            if slot.pinned:
                try:
                    self._start_load(slot).result()
                except ModelUnavailableError as e:
                    raise RuntimeError(f"pinned {e}") from None

    # -- ServeEngine ------------------------------------------------------------------------
    async def submit(self, request: GenerateRequest) -> GenerationHandle:
        slot = self._slots[self.resolve(request.model)]
        with self._lock:
            slot.entering += 1
        try:
            loaded = await self._ready(slot)
            _check_vocabulary(request, loaded.vocab_size)
            planned = await self._plan(slot, loaded, request)
            await self._room_for(slot, planned)
            with self._lock:
                slot.entering_kv += planned  # held from the check on: no other request takes the same room
            try:
                handle = await loaded.engine.submit(request)
            finally:
                with self._lock:
                    slot.entering_kv -= planned
            with self._lock:
                slot.planned[handle.generation_id] = planned
            return handle
        finally:
            with self._lock:
                slot.entering -= 1
                slot.last_used = self._clock()

    async def count_tokens(self, request: GenerateRequest) -> int:
        slot = self._slots[self.resolve(request.model)]
        with self._lock:
            slot.entering += 1
        try:
            return await (await self._ready(slot)).engine.count_tokens(request)
        finally:
            with self._lock:
                slot.entering -= 1
                slot.last_used = self._clock()

    def queue_depth(self) -> int:
        return sum(e.queue_depth() for e in self._engines())

    def batch_size(self) -> int:
        return sum(e.batch_size() for e in self._engines())

    def cache_stats(self) -> Mapping[str, int | float]:
        """The loaded models' counts added up (per-model state is on /v1/models)."""
        total: dict[str, int | float] = {"models_loaded": len(self._engines())}
        for engine in self._engines():
            for name, value in engine.cache_stats().items():
                total[name] = total.get(name, 0) + value
        return total

    def flush(self, timeout: float) -> FlushResult:
        results = [e.flush(timeout) for e in self._engines()]
        return FlushResult(all(r.settled for r in results), sum(r.written for r in results), sum(r.failed for r in results))

    def generation_state(self, generation_id: str) -> Mapping[str, object] | None:
        return next((s for e in self._engines() if (s := e.generation_state(generation_id)) is not None), None)

    def health(self) -> str:
        reports = [getattr(e, "health", lambda: "ok")() for e in self._engines()]
        return "degraded" if "degraded" in reports else "ok"

    def close(self, timeout: float) -> None:
        self._stop.set()
        self._loads.shutdown(wait=True)
        for slot in self._slots.values():
            if slot.loaded is not None:
                self._unload(slot, timeout)

    # -- loading ----------------------------------------------------------------------------
    async def _ready(self, slot: _Slot) -> LoadedModel:
        with self._lock:
            loaded = slot.loaded
            pending = None if loaded is not None else self._start_load(slot)
        if loaded is not None:
            return loaded
        assert pending is not None
        return await asyncio.wrap_future(pending)

    def _start_load(self, slot: _Slot) -> Future[LoadedModel]:
        with self._lock:
            if slot.loading is None:
                slot.loading = self._loads.submit(self._load, slot)
            return slot.loading

    def _load(self, slot: _Slot) -> LoadedModel:
        """On the loader thread: make room (max_models and the memory budget), then load."""
        name = slot.spec.name
        try:
            need = self._estimate(slot.spec)
            self._make_room(slot, lambda: self._fits_model(need), lambda: self._budget.refuse_model(name, need, self._resident()))
            log.info("loading model %s", name)
            started = time.perf_counter()
            loaded = self._loader(slot.spec)
        except ModelUnavailableError as e:
            self._loaded(slot, None, str(e))
            raise
        except Exception as e:  # noqa: BLE001 - a model that fails to load leaves the others serving
            log.error("model %s failed to load", name, exc_info=e)
            self._loaded(slot, None, f"{type(e).__name__}: {e}")
            raise ModelUnavailableError(f"the model {name!r} failed to load: {type(e).__name__}: {e}") from None
        log.info("model %s loaded in %.1f s (%d MB resident)", name, time.perf_counter() - started, loaded.resident_bytes >> 20)
        self._loaded(slot, loaded, None)
        return loaded

    def _loaded(self, slot: _Slot, loaded: LoadedModel | None, error: str | None) -> None:
        with self._lock:
            slot.loaded, slot.loading, slot.error, slot.last_used = loaded, None, error, self._clock()

    def _fits_model(self, need: int) -> bool:
        loaded = sum(1 for s in self._slots.values() if s.loaded is not None)
        return loaded < self.max_models and self._budget.fits(self._resident() + self._planned() + need)

    def _make_room(self, slot: _Slot, fits: Callable[[], bool], refuse: Callable[[], ModelUnavailableError]) -> None:
        """Unload idle models, least recently used first, until `fits`; wait for busy ones (up to
        `wait_s`); raise `refuse()` when nothing loaded or running could make room."""
        deadline = self._clock() + self.wait_s
        while True:
            with self._lock:
                if fits():
                    return
                victim = self._idle_victim(slot)
                if victim is None and not self._planned() and not any(
                        s is not slot and s.loaded is not None and not s.pinned for s in self._slots.values()):
                    raise refuse()
            if victim is not None:
                self._unload(victim, CLOSE_TIMEOUT_S)
            elif self._clock() > deadline:
                raise ModelUnavailableError(f"every loaded model is busy; {slot.spec.name!r} waited {self.wait_s:.0f} s "
                                            "for room", retry_after_s=1)
            else:
                time.sleep(POLL_S)

    def _idle_victim(self, slot: _Slot) -> _Slot | None:
        """The least recently used loaded model, other than `slot`, that is idle and not pinned."""
        with self._lock:
            idle = [s for s in self._slots.values() if s is not slot and s.loaded is not None and not s.pinned and self._idle(s)]
            return min(idle, key=lambda s: s.last_used, default=None)

    def _unload(self, slot: _Slot, timeout: float) -> None:
        with self._lock:
            loaded, slot.loaded = slot.loaded, None
        if loaded is None:
            return
        log.info("unloading model %s", slot.spec.name)
        loaded.release(timeout)  # flushes its write-behind: what it cached stays on the SSD
        del loaded
        gc.collect()

    def _idle(self, slot: _Slot) -> bool:
        """No request is on its way into the model or in it (its planned KV pruned of ended ones)."""
        loaded = slot.loaded
        if loaded is None:
            return True
        self._prune(slot)
        engine = loaded.engine
        return slot.entering == 0 and not slot.planned and engine.queue_depth() == 0 and engine.batch_size() == 0

    def _reap(self) -> None:
        """Unload models idle for `ttl_s` (not pinned)."""
        while not self._stop.wait(min(1.0, self.ttl_s / 4)):
            now = self._clock()
            with self._lock:
                expired = [s for s in self._slots.values() if s.loaded is not None and not s.pinned
                           and s.loading is None and now - s.last_used >= self.ttl_s and self._idle(s)]
            for slot in expired:
                log.info("model %s idle for %.0f s", slot.spec.name, now - slot.last_used)
                try:
                    self._loads.submit(self._unload_if_idle, slot)
                except RuntimeError:  # closing: close() unloads it
                    return

    def _unload_if_idle(self, slot: _Slot) -> None:
        with self._lock:
            if not self._idle(slot) or self._clock() - slot.last_used < self.ttl_s:
                return
        self._unload(slot, CLOSE_TIMEOUT_S)

    # -- memory -----------------------------------------------------------------------------
    async def _plan(self, slot: _Slot, loaded: LoadedModel, request: GenerateRequest) -> int:
        return await plan_kv(self._budget, slot.spec.name, loaded.engine, request, resident=loaded.resident_bytes,
                             kv_per_token=loaded.kv_bytes_per_token, context_length=loaded.context_length,
                             in_use=self._resident() + self._planned())

    async def _room_for(self, slot: _Slot, planned: int) -> None:
        """Wait until the request's KV fits beside the loaded models and the running requests'
        KV, unloading idle models first (up to `wait_s`, then a 503)."""
        deadline = self._clock() + self.wait_s
        while not self._budget.fits(self._resident() + self._planned() + planned):
            victim = self._idle_victim(slot)
            if victim is not None:
                await asyncio.get_running_loop().run_in_executor(None, self._unload, victim, CLOSE_TIMEOUT_S)
            elif self._clock() > deadline:
                raise ModelUnavailableError(f"the request's KV did not fit in the memory budget within {self.wait_s:.0f} s "
                                            "(other requests hold it)", retry_after_s=1)
            else:
                await asyncio.sleep(POLL_S)

    def _resident(self) -> int:
        with self._lock:
            return sum(s.loaded.resident_bytes for s in self._slots.values() if s.loaded is not None)

    def _planned(self) -> int:
        with self._lock:
            for slot in self._slots.values():
                self._prune(slot)
            return sum(sum(s.planned.values()) + s.entering_kv for s in self._slots.values())

    def _prune(self, slot: _Slot) -> None:
        """Forget the planned KV of generations that ended."""
        if slot.loaded is None:
            slot.planned.clear()
            return
        state = slot.loaded.engine.generation_state
        for generation_id in [g for g in slot.planned if (state(g) or {}).get("status") not in LIVE]:
            del slot.planned[generation_id]

    def _engines(self) -> list[ServeEngine]:
        with self._lock:
            return [s.loaded.engine for s in self._slots.values() if s.loaded is not None]


def _state(slot: _Slot) -> str:
    if slot.loaded is not None:
        return "loaded"
    if slot.loading is not None:
        return "loading"
    return "failed" if slot.error is not None else "unloaded"


def _check_vocabulary(request: GenerateRequest, vocab_size: int) -> None:
    """logit_bias ids must be in the model's vocabulary (the HTTP layer does not know which model)."""
    bad = [t for t in request.sampling.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"'logit_bias' token id {bad[0]} is outside the vocabulary [0, {vocab_size}) of {request.model!r}")
