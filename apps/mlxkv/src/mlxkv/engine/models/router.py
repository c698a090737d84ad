"""`ModelRouter`: the `ServeEngine` and `ModelCatalog` over several models, each request served by
its `model`; it wires the parts of this package together.

    submit -> resolve name -> ready (load: make room -> load) -> memory room for the request -> engine
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from mlxkv_serve import (
    FlushResult, GenerateRequest, GenerationHandle, ModelInfo, ModelUnavailableError, ServeEngine, UnknownModelError,
)
from mlxkv_serve.engine import CachedPrefix, PrefixLookup

from mlxkv.engine.memory import MemoryBudget, plan_kv
from mlxkv.engine.models.eviction import Eviction, TtlReaper
from mlxkv.engine.models.loading import ModelLoads
from mlxkv.engine.models.model_adapters import ModelAdapters
from mlxkv.engine.models.residents import Residents
from mlxkv.engine.models.specs import Loader, ModelPolicy, ModelSpec


class ModelRouter:
    """`ServeEngine`, `ModelCatalog` and `AdapterManaging` over several models (see the package docstring)."""

    def __init__(self, specs: list[ModelSpec], loader: Loader, policy: ModelPolicy, *, budget: MemoryBudget,
                 estimate: Callable[[ModelSpec], int], clock: Callable[[], float] = time.monotonic,
                 discover: Callable[[str], ModelSpec | None] | None = None) -> None:
        """`estimate`: the bytes a model will hold once loaded (weights and RAM tier), before it
        loads. `discover`: a model for a name not registered (a Hugging Face id in the hub cache)."""
        names = [s.name for s in specs]
        if len(specs) < 2 or len(set(names)) != len(names):
            raise ValueError(f"a router serves two or more models with distinct names, not {names}")
        policy.check_names(names)
        self.policy = policy
        self._discover = discover
        self._residents = Residents(specs, policy.pinned, clock)
        self._eviction = Eviction(self._residents, policy, budget)
        self._loads = ModelLoads(self._residents, loader, estimate, self._eviction)
        self._reaper = TtlReaper(self._residents, policy.ttl_s, self._loads.executor) if policy.ttl_s > 0 else None
        self._adapters = ModelAdapters(self._residents, self._loads, policy.adapter_dirs)

    # -- catalog ----------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.policy.default or self._residents.names()[0]

    def resolve(self, asked: str | None) -> str:
        if asked is not None and asked in self._residents:
            return asked
        if asked and asked.rpartition(":")[0] in self._residents:  # `<model>:ADAPTER`: that model's adapter
            return asked.rpartition(":")[0]
        found = self._discover(asked) if asked and self._discover is not None else None
        if found is not None:
            self._residents.register(found)
            return found.name
        if self.policy.default is not None:
            return self.policy.default
        raise UnknownModelError(f"the model {asked!r} does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self._residents.names())}")

    def models(self) -> tuple[ModelInfo, ...]:
        return self._residents.infos(_health)

    # -- AdapterManaging: `model` is a registered model (None: --default-model) ----------------
    async def add_adapter(self, name: str, path: str, model: str | None = None) -> Mapping[str, object]:
        return await self._adapters.add(self._residents[self._adapter_model(model)], name, path)

    async def remove_adapter(self, name: str, model: str | None = None) -> str | None:
        return await self._adapters.remove(self._residents[self._adapter_model(model)], name)

    def _adapter_model(self, asked: str | None) -> str:
        """The model an adapter is added to or removed from: one registered (or found in the hub
        cache) by that name, never --default-model in place of a name that matches none."""
        names = ", ".join(repr(n) for n in self._residents.names())
        if asked is None:
            if self.policy.default is None:
                raise UnknownModelError(f"say which model the adapter is for ('model' in the body, or DELETE "
                                        f"/v1/adapters/MODEL:NAME): one of {names} (there is no --default-model)")
            return self.policy.default
        if asked in self._residents:
            return asked
        found = self._discover(asked) if self._discover is not None else None
        if found is None:
            raise UnknownModelError(f"the model {asked!r} does not exist; this server serves {names}")
        self._residents.register(found)
        return found.name

    def load_pinned(self) -> None:
        """Load the pinned models now (start-up): they are never unloaded."""
        for entry in self._residents.entries():
            if entry.pinned:
                try:
                    self._loads.start(entry).result()
                except ModelUnavailableError as e:
                    raise RuntimeError(f"pinned {e}") from None

    # -- ServeEngine ------------------------------------------------------------------------
    async def submit(self, request: GenerateRequest) -> GenerationHandle:
        entry = self._residents[self.resolve(request.model)]
        with self._residents.entering(entry):
            loaded = await self._loads.ready(entry)
            _check_vocabulary(request, loaded.vocab_size)
            planned = await plan_kv(self._eviction.budget, entry.name, loaded.engine, request, resident=loaded.resident_bytes,
                                    kv_per_token=loaded.kv_bytes_per_token, context_length=loaded.context_length,
                                    in_use=self._eviction.in_use())
            await self._eviction.room_for_request(entry, planned)  # reserves it: no other request takes the same room
            lock = self._residents.lock
            try:
                handle = await loaded.engine.submit(_for_engine(request, entry.name, loaded.engine))
            finally:
                with lock:
                    entry.entering_kv -= planned
            with lock:
                entry.planned[handle.generation_id] = planned
            return handle

    async def count_tokens(self, request: GenerateRequest) -> int:
        entry = self._residents[self.resolve(request.model)]
        with self._residents.entering(entry):
            engine = (await self._loads.ready(entry)).engine
            return await engine.count_tokens(_for_engine(request, entry.name, engine))

    async def cached_prefix(self, request: GenerateRequest) -> CachedPrefix:
        """What the request's model holds of its prompt, when it is loaded; a model not loaded is
        not loaded for the question (its tokenizer, and so the prompt's tokens, are not known)."""
        entry = self._residents[self.resolve(request.model)]
        with self._residents.lock:
            loaded, state = entry.loaded, entry.state
        if loaded is None or not isinstance(loaded.engine, PrefixLookup):
            return CachedPrefix(None, 0, None, entry.name, state)
        found = await loaded.engine.cached_prefix(_for_engine(request, entry.name, loaded.engine))
        return replace(found, model=entry.name, state=state)

    def queue_depth(self) -> int:
        return sum(e.queue_depth() for e in self._residents.engines())

    def batch_size(self) -> int:
        return sum(e.batch_size() for e in self._residents.engines())

    def cache_stats(self) -> Mapping[str, int | float]:
        """The loaded models' counts added up (per-model state is on /v1/models and /health)."""
        engines = self._residents.engines()
        total: dict[str, int | float] = {"models_loaded": len(engines)}
        for engine in engines:
            for name, value in engine.cache_stats().items():
                total[name] = total.get(name, 0) + value
        return total

    def flush(self, timeout: float) -> FlushResult:
        results = [e.flush(timeout) for e in self._residents.engines()]
        return FlushResult(all(r.settled for r in results), sum(r.written for r in results), sum(r.failed for r in results))

    def generation_state(self, generation_id: str) -> Mapping[str, object] | None:
        return next((s for e in self._residents.engines() if (s := e.generation_state(generation_id)) is not None), None)

    def memory(self) -> Mapping[str, int | None]:
        """The budget, the plan (every loaded model and its requests) and the process's measured memory."""
        return self._eviction.budget.status(self._eviction.in_use()).as_json()

    def health(self) -> str:
        return "degraded" if "degraded" in [_health(e) for e in self._residents.engines()] else "ok"

    def close(self, timeout: float) -> None:
        if self._reaper is not None:
            self._reaper.stop()
        self._loads.shutdown()
        for entry in self._residents.entries():
            if entry.loaded is not None:
                self._residents.unload(entry, timeout)


def _health(engine: ServeEngine) -> str:
    return str(getattr(engine, "health", lambda: "ok")())


def _for_engine(request: GenerateRequest, name: str, engine: ServeEngine) -> GenerateRequest:
    """`request` as the model's own engine reads it: `<name>:ADAPTER` is `<its model id>:ADAPTER`
    there (an adapter it does not hold is a 404, not the base model)."""
    model = request.model
    if model is not None and model.startswith(f"{name}:"):
        return replace(request, model=f"{engine.model_id}:{model[len(name) + 1:]}")
    return request


def _check_vocabulary(request: GenerateRequest, vocab_size: int) -> None:
    """logit_bias ids must be in the model's vocabulary (the HTTP layer does not know which model)."""
    bad = [t for t in request.sampling.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"'logit_bias' token id {bad[0]} is outside the vocabulary [0, {vocab_size}) of {request.model!r}")

