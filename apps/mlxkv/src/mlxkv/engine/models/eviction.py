"""Room for a model or a request: the least recently used idle model that is not pinned unloads
until a load fits in `max_models` and the memory budget, or a request's KV fits in the budget; a
model idle for `ttl_s` unloads on its own (`TtlReaper`). With a measuring budget, memory beyond
the plan is given back first (MLX's buffer cache, the loaded models' RAM tiers)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Executor

from mlxkv_serve import ModelUnavailableError

from mlxkv.engine.measured import MemoryStatus
from mlxkv.engine.memory import MemoryBudget, release_ram
from mlxkv.engine.models.residents import ModelEntry, Residents
from mlxkv.engine.models.specs import ModelPolicy

POLL_S = 0.05  # how often a load or a request waiting for room looks again
CLOSE_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)


class Eviction:
    def __init__(self, residents: Residents, policy: ModelPolicy, budget: MemoryBudget) -> None:
        self._residents, self._policy, self.budget = residents, policy, budget

    def in_use(self) -> int:
        """The loaded models' bytes and the KV their requests plan for."""
        return self._residents.resident() + self._residents.planned()

    def room(self, more: int) -> MemoryStatus:
        """The budget's status for `more` planned bytes, after giving measured memory back."""
        return self.budget.room(self.in_use(), more, (self._release_ram,))

    def room_for_model(self, entry: ModelEntry, need: int) -> None:
        """On the loader thread: unload idle models, least recently used first, until a load of
        `need` bytes fits; wait for busy ones (up to `wait_s`); raise `ModelUnavailableError`
        when nothing loaded or running could make room."""
        residents, wait_s = self._residents, self._policy.wait_s
        deadline = residents.clock() + wait_s
        while True:
            self.room(need)  # gives measured memory back first; outside the lock, as it may wait for MLX
            with residents.lock:
                status = self.budget.status(self.in_use())
                if residents.loaded_count() < self._policy.max_models and status.fits(need):
                    entry.reserved = need  # held from here until it is loaded (or failed)
                    return
                victim = self.idle_victim(entry)
                if victim is None and not residents.planned() and not any(
                        e is not entry and e.loaded is not None and not e.pinned for e in residents.entries()):
                    raise self.budget.refuse_model(entry.name, need, residents.resident(), status)
            if victim is not None:
                residents.unload(victim, CLOSE_TIMEOUT_S)
            elif residents.clock() > deadline:
                raise ModelUnavailableError(f"every loaded model is busy; {entry.name!r} waited {wait_s:.0f} s for room",
                                            retry_after_s=1)
            else:
                time.sleep(POLL_S)

    async def room_for_request(self, entry: ModelEntry, planned: int) -> None:
        """Wait until a request's `planned` KV fits beside the loaded models and the running
        requests' KV, unloading idle models first (up to `wait_s`, then a 503), and reserve it
        (`entry.entering_kv`: the caller gives it back once the engine holds the request)."""
        residents, wait_s = self._residents, self._policy.wait_s
        deadline = residents.clock() + wait_s
        while True:
            # NOTE: off the event loop: letting MLX's cache go waits for the CPU streams' work in flight
            await asyncio.to_thread(self.room, planned)
            with residents.lock:  # checked and reserved together: another request's check may have run beside this one's
                status = self.budget.status(self.in_use())
                if status.fits(planned):
                    entry.entering_kv += planned
                    return
            victim = self.idle_victim(entry)
            if victim is not None:
                await asyncio.get_running_loop().run_in_executor(None, residents.unload, victim, CLOSE_TIMEOUT_S)
            elif not residents.planned():  # nothing running gives memory back by ending
                raise self.budget.refuse_kv(planned, status, "beside the loaded models and what the process holds")
            elif residents.clock() > deadline:
                raise self.budget.refuse_kv(planned, status, f"within {wait_s:.0f} s (other requests hold it)")
            else:
                await asyncio.sleep(POLL_S)

    def _release_ram(self, nbytes: int) -> int:
        return release_ram(self._residents.engines(), nbytes)

    def idle_victim(self, entry: ModelEntry) -> ModelEntry | None:
        """The least recently used loaded model, other than `entry`, that is idle and not pinned."""
        residents = self._residents
        with residents.lock:
            idle = [e for e in residents.entries() if e is not entry and e.loaded is not None and not e.pinned and residents.idle(e)]
            return min(idle, key=lambda e: e.last_used, default=None)


class TtlReaper:
    """A thread that unloads models idle for `ttl_s` (not pinned), on the loader's executor."""

    def __init__(self, residents: Residents, ttl_s: float, executor: Executor) -> None:
        self._residents, self._ttl_s, self._executor = residents, ttl_s, executor
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxkv-model-ttl", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        residents = self._residents
        while not self._stop.wait(min(1.0, self._ttl_s / 4)):
            now = residents.clock()
            with residents.lock:
                expired = [e for e in residents.entries() if e.loaded is not None and not e.pinned
                           and e.loading is None and now - e.last_used >= self._ttl_s and residents.idle(e)]
            for entry in expired:
                log.info("model %s idle for %.0f s", entry.name, now - entry.last_used)
                try:
                    self._executor.submit(self._unload_if_idle, entry)
                except RuntimeError:  # closing: the router's close unloads it
                    return

    def _unload_if_idle(self, entry: ModelEntry) -> None:
        residents = self._residents
        with residents.lock:
            if not residents.idle(entry) or residents.clock() - entry.last_used < self._ttl_s:
                return
        residents.unload(entry, CLOSE_TIMEOUT_S)

