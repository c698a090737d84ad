"""Models load on one loader thread, so a load never holds up the event loop or another model's
decoding; the requests for a model being loaded wait for the same load."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from mlxkv_serve import ModelUnavailableError

from mlxkv.engine.models.eviction import Eviction
from mlxkv.engine.models.residents import ModelEntry, Residents
from mlxkv.engine.models.specs import LoadedModel, Loader, ModelSpec

log = logging.getLogger(__name__)


class ModelLoads:
    def __init__(self, residents: Residents, loader: Loader, estimate: Callable[[ModelSpec], int], eviction: Eviction) -> None:
        """`estimate`: the bytes a model will hold once loaded (weights and RAM tier), before it loads."""
        self._residents, self._loader, self._estimate, self._eviction = residents, loader, estimate, eviction
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="mlxkv-model-load")

    async def ready(self, entry: ModelEntry) -> LoadedModel:
        """`entry`'s loaded model, loading it first (or waiting for the load under way)."""
        with self._residents.lock:
            loaded = entry.loaded
            pending = None if loaded is not None else self.start(entry)
        if loaded is not None:
            return loaded
        assert pending is not None
        return await asyncio.wrap_future(pending)

    def start(self, entry: ModelEntry) -> Future[LoadedModel]:
        with self._residents.lock:
            if entry.loading is None:
                entry.loading = self.executor.submit(self._load, entry)
            return entry.loading

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)

    def _load(self, entry: ModelEntry) -> LoadedModel:
        """On the loader thread: make room (max_models and the memory budget), then load."""
        name = entry.name
        try:
            self._eviction.room_for_model(entry, self._estimate(entry.spec))
            log.info("loading model %s", name)
            started = time.perf_counter()
            loaded = self._loader(entry.spec)
        except ModelUnavailableError as e:
            self._residents.set_loaded(entry, None, str(e))
            raise
        except Exception as e:  # noqa: BLE001 - a model that fails to load leaves the others serving
            log.error("model %s failed to load", name, exc_info=e)
            self._residents.set_loaded(entry, None, f"{type(e).__name__}: {e}")
            raise ModelUnavailableError(f"the model {name!r} failed to load: {type(e).__name__}: {e}") from None
        log.info("model %s loaded in %.1f s (%d MB resident)", name, time.perf_counter() - started, loaded.resident_bytes >> 20)
        self._residents.set_loaded(entry, loaded, None)
        return loaded
