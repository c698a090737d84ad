"""The registered models' bookkeeping under one lock: which is loaded or loading, when each was
last used, the requests on their way into it and the KV its running requests plan for."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

from mlxkv_serve import ModelInfo, ServeEngine

from mlxkv.engine.memory import LIVE
from mlxkv.engine.models.specs import LoadedModel, ModelSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelEntry:
    """One registered model and what is in it."""

    spec: ModelSpec
    pinned: bool
    loaded: LoadedModel | None = None
    loading: Future[LoadedModel] | None = None
    error: str | None = None
    last_used: float = 0.0
    entering: int = 0  # requests between choosing this model and its engine holding them
    entering_kv: int = 0  # the planned KV of those past the budget check
    planned: dict[str, int] = field(default_factory=dict)  # generation id -> planned KV bytes
    reserved: int = 0  # the bytes a load under way was given room for

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def state(self) -> str:
        if self.loaded is not None:
            return "loaded"
        if self.loading is not None:
            return "loading"
        return "failed" if self.error is not None else "unloaded"


class Residents:
    """The registered models by name (in registration order); every field of an entry is read and
    written under `lock`."""

    def __init__(self, specs: list[ModelSpec], pinned: tuple[str, ...], clock: Callable[[], float]) -> None:
        self._entries = {s.name: ModelEntry(s, s.name in pinned) for s in specs}
        self.lock = threading.RLock()
        self.clock = clock

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> ModelEntry:
        return self._entries[name]

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[ModelEntry]:
        with self.lock:
            return list(self._entries.values())

    def register(self, spec: ModelSpec) -> None:
        """A model found after start-up (a Hugging Face id in the hub cache); never pinned."""
        with self.lock:
            self._entries.setdefault(spec.name, ModelEntry(spec, False))

    def infos(self, health: Callable[[ServeEngine], str]) -> tuple[ModelInfo, ...]:
        with self.lock:
            return tuple(ModelInfo(e.name, e.state, e.pinned, e.error, health(e.loaded.engine) if e.loaded else None,
                                   e.spec.adapter_names()) for e in self._entries.values())

    @contextmanager
    def entering(self, entry: ModelEntry) -> Iterator[None]:
        """A request on its way into `entry`'s engine: the model is busy, then freshly used."""
        with self.lock:
            entry.entering += 1
        try:
            yield
        finally:
            with self.lock:
                entry.entering -= 1
                entry.last_used = self.clock()

    def set_loaded(self, entry: ModelEntry, loaded: LoadedModel | None, error: str | None) -> None:
        with self.lock:
            entry.loaded, entry.loading, entry.error, entry.last_used = loaded, None, error, self.clock()
            entry.reserved = 0

    def unload(self, entry: ModelEntry, timeout: float) -> None:
        """Close `entry`'s engine: its write-behind is flushed, so what it cached stays on the SSD."""
        with self.lock:
            loaded, entry.loaded = entry.loaded, None
        if loaded is None:
            return
        log.info("unloading model %s", entry.name)
        loaded.release(timeout)
        del loaded
        gc.collect()

    def engines(self) -> list[ServeEngine]:
        with self.lock:
            return [e.loaded.engine for e in self._entries.values() if e.loaded is not None]

    def loaded_count(self) -> int:
        with self.lock:
            return sum(1 for e in self._entries.values() if e.loaded is not None)

    def resident(self) -> int:
        """The bytes the loaded models hold (weights and RAM tier caps), and those being loaded will."""
        with self.lock:
            return sum(e.loaded.resident_bytes if e.loaded is not None else e.reserved for e in self._entries.values())

    def planned(self) -> int:
        """The KV bytes the models' running requests and those on their way plan for."""
        with self.lock:
            for entry in self._entries.values():
                self._prune(entry)
            return sum(sum(e.planned.values()) + e.entering_kv for e in self._entries.values())

    def idle(self, entry: ModelEntry) -> bool:
        """No request is on its way into the model or in it (its planned KV pruned of ended ones)."""
        with self.lock:
            loaded = entry.loaded
            if loaded is None:
                return True
            self._prune(entry)
            engine = loaded.engine
            return entry.entering == 0 and not entry.planned and engine.queue_depth() == 0 and engine.batch_size() == 0

    def _prune(self, entry: ModelEntry) -> None:
        """Forget the planned KV of generations that ended."""
        if entry.loaded is None:
            entry.planned.clear()
            return
        state = entry.loaded.engine.generation_state
        for generation_id in [g for g in entry.planned if (state(g) or {}).get("status") not in LIVE]:
            del entry.planned[generation_id]
