"""`BudgetedEngine`: a one-model server's engine under the memory budget. A request whose planned
KV could never fit beside the model is refused (400); one that fits once running requests end
waits for them (then 503 after `wait_s`). Measured memory beyond the plan counts too: MLX's
buffer cache and the RAM tier give it back first; when it still stands in the way and no running
request will end to free memory, the request gets a 503 now, with the numbers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence

from mlxkv_serve import FlushResult, GenerateRequest, GenerationHandle, ServeEngine
from mlxkv_serve.engine import AdapterManaging, AdapterServing, CachedPrefix, PrefixLookup

from mlxkv.engine.measured import MemoryStatus
from mlxkv.engine.memory import LIVE, MemoryBudget, plan_kv, release_ram

POLL_S = 0.05
DEFAULT_WAIT_S = 300.0


class BudgetedEngine:
    def __init__(self, engine: ServeEngine, budget: MemoryBudget, *, resident: int, kv_per_token: int, context_length: int,
                 wait_s: float = DEFAULT_WAIT_S) -> None:
        self.engine, self.budget, self.wait_s = engine, budget, wait_s
        self.resident, self.kv_per_token, self.context_length = resident, kv_per_token, context_length
        self._planned: dict[str, int] = {}  # generation id -> planned KV bytes
        self._entering = 0  # planned KV of requests on their way into the engine

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    async def submit(self, request: GenerateRequest) -> GenerationHandle:
        planned = await plan_kv(self.budget, self.model_id, self.engine, request, resident=self.resident,
                                kv_per_token=self.kv_per_token, context_length=self.context_length, in_use=self.in_use())
        deadline = time.monotonic() + self.wait_s
        while True:
            await self._room(planned)
            # Decided on the loop, with no await before the reservation: another request's room
            # check may have run beside this one's, and only one of them may take the room.
            status = self.budget.status(self.in_use())
            if status.fits(planned):
                break
            if self.in_use() == self.resident:  # nothing running gives memory back by ending
                raise self.budget.refuse_kv(planned, status, "beside what the process holds")
            if time.monotonic() > deadline:
                raise self.budget.refuse_kv(planned, status, f"within {self.wait_s:.0f} s (other requests hold it)")
            await asyncio.sleep(POLL_S)
        self._entering += planned  # held from the check on: no other request takes the same room
        try:
            handle = await self.engine.submit(request)
        finally:
            self._entering -= planned
        self._planned[handle.generation_id] = planned
        return handle

    def in_use(self) -> int:
        """The model and the planned KV of the requests in it or on their way."""
        state = self.engine.generation_state
        for generation_id in [g for g in self._planned if (state(g) or {}).get("status") not in LIVE]:
            del self._planned[generation_id]
        return self.resident + self._entering + sum(self._planned.values())

    def memory(self) -> Mapping[str, int | None]:
        """The budget, the plan and the process's measured memory (for /health)."""
        return self.budget.status(self.in_use()).as_json()

    async def _room(self, planned: int) -> MemoryStatus:
        # NOTE: off the event loop: letting MLX's cache go waits for the CPU streams' work in flight
        return await asyncio.to_thread(self.budget.room, self.in_use(), planned, (self._release_ram,))

    def _release_ram(self, nbytes: int) -> int:
        return release_ram([self.engine], nbytes)

    async def count_tokens(self, request: GenerateRequest) -> int:
        return await self.engine.count_tokens(request)

    def queue_depth(self) -> int:
        return self.engine.queue_depth()

    def batch_size(self) -> int:
        return self.engine.batch_size()

    def cache_stats(self) -> Mapping[str, int | float]:
        return self.engine.cache_stats()

    def flush(self, timeout: float) -> FlushResult:
        return self.engine.flush(timeout)

    def generation_state(self, generation_id: str) -> Mapping[str, object] | None:
        return self.engine.generation_state(generation_id)

    def health(self) -> str:
        health = getattr(self.engine, "health", None)
        return str(health()) if health is not None else "ok"

    def close(self, timeout: float) -> None:
        self.engine.close(timeout)

    # The wrapped engine's adapters and prefix lookup, where it has them (the budget does not bound them).
    def adapter_names(self) -> Sequence[str]:
        return self.engine.adapter_names() if isinstance(self.engine, AdapterServing) else ()

    async def add_adapter(self, name: str, path: str, model: str | None = None) -> Mapping[str, object]:
        if not isinstance(self.engine, AdapterManaging):
            raise ValueError("this server's engine takes no adapters")
        return await self.engine.add_adapter(name, path, model)

    async def remove_adapter(self, name: str, model: str | None = None) -> str | None:
        return await self.engine.remove_adapter(name, model) if isinstance(self.engine, AdapterManaging) else None

    async def cached_prefix(self, request: GenerateRequest) -> CachedPrefix:
        if not isinstance(self.engine, PrefixLookup):
            raise ValueError("this server's engine has no prompt cache index")
        return await self.engine.cached_prefix(request)
