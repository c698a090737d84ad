"""The memory budget: the bytes loaded models (weights and RAM prompt tier) and the running
requests' planned KV may hold together, so that work which does not fit is refused or waits
instead of growing until the kernel kills the process. With a gauge, what the process really
holds counts too (see `measured.py`): memory beyond the plan is first given back (MLX's buffer
cache, then the RAM tiers), and what remains of it is in use like planned bytes."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from mlxkv_serve import GenerateRequest, ModelUnavailableError, ServeEngine

from mlxkv.engine.measured import MemoryGauge, MemoryStatus

# What the default leaves to the OS, other processes and what requests grow beyond their plan
# between two admissions (memory is measured at admission only): a quarter of the machine.
DEFAULT_SHARE = 0.75
LIVE = ("queued", "running")  # a generation's status while its KV is planned
Relief = Callable[[int], int]  # asked to give back about N bytes; returns the bytes it let go of


class MemoryBudgetError(ValueError):
    """A request whose planned KV cannot fit in the budget even alone (a 400: ask for less)."""


@runtime_checkable
class RamReleasing(Protocol):
    """An engine whose RAM prompt tier can give memory back (its entries stay on the SSD)."""

    def release_ram(self, nbytes: int) -> int:
        """Evict about `nbytes` of RAM tier entries, least recently used first; the bytes evicted."""
        ...


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """`limit_bytes` against the plan and, with a `gauge`, the process's measured memory."""

    limit_bytes: int
    gauge: MemoryGauge | None = None  # None: the plan alone counts

    def __post_init__(self) -> None:
        if self.limit_bytes < 1:
            raise ValueError(f"memory budget={self.limit_bytes} bytes must be >= 1")

    def fits(self, total_bytes: int) -> bool:
        """Whether planned bytes alone fit (what a request could never exceed, whatever else runs)."""
        return total_bytes <= self.limit_bytes

    def status(self, planned: int) -> MemoryStatus:
        """The budget against `planned` bytes and, with a gauge, a reading taken now."""
        return MemoryStatus(self.limit_bytes, planned, self.gauge.read() if self.gauge is not None else None)

    def room(self, planned: int, more: int, relief: Sequence[Relief] = ()) -> MemoryStatus:
        """The status for `more` planned bytes beside `planned`, after giving memory back when
        measured memory beyond the plan is what stands in the way: MLX's buffer cache first, then
        each `relief` step in turn, asked for the excess. `fits(more)` on it decides."""
        status = self.status(planned)
        if status.fits(more) or not status.unplanned_bytes or self.gauge is None:
            return status
        self.gauge.release_cache()
        status = self.status(planned)
        for step in relief:
            if status.fits(more) or not status.unplanned_bytes:
                break
            if step(status.in_use_bytes + more - self.limit_bytes) > 0:
                status = self.status(planned)
        return status

    def refuse_model(self, name: str, need: int, resident: int, status: MemoryStatus | None = None) -> ModelUnavailableError:
        other = f"; pinned or busy models hold {_mb(resident)}" if resident else ""
        measured = f"; {status.held()}" if status is not None and status.reading is not None else ""
        return ModelUnavailableError(f"the model {name!r} needs about {_mb(need)} (weights and RAM prompt cache) and the "
                                     f"memory budget is {_mb(self.limit_bytes)} (--memory-budget){other}{measured}",
                                     retry_after_s=1 if measured else None)

    def check_model(self, name: str, weights: int, ram_cache: int) -> None:
        """Raise ValueError (at start-up, one model) when `name` cannot fit beside what the
        process holds already."""
        status = self.status(0)
        if not status.fits(weights + ram_cache):
            held = f"; the process holds {_mb(status.unplanned_bytes)} already" if status.unplanned_bytes else ""
            raise ValueError(f"the model {name!r} needs about {_mb(weights)} of weights and {_mb(ram_cache)} of RAM prompt "
                             f"cache (--prompt-cache-bytes) and the memory budget is {_mb(self.limit_bytes)} (--memory-budget)"
                             f"{held}")

    def refuse_kv(self, planned: int, status: MemoryStatus, why: str) -> ModelUnavailableError:
        """The 503 for a request whose planned KV does not fit now (`why`: what it waited for)."""
        return ModelUnavailableError(f"the request's {_mb(planned)} of KV does not fit in the memory budget {why}: "
                                     f"{status.describe()}", retry_after_s=1)

    def refuse_request(self, name: str, prompt: int, answer: int, kv_per_token: int, resident: int) -> str:
        return (f"the request plans {_mb((prompt + answer) * kv_per_token)} of KV ({prompt} prompt + {answer} answer tokens at "
                f"{kv_per_token} bytes a token); with the model {name!r} ({_mb(resident)}) that passes the memory budget of "
                f"{_mb(self.limit_bytes)} (--memory-budget); ask for fewer max_tokens or send a shorter prompt")


def default_memory_budget() -> int:
    """Three quarters of the machine's physical memory."""
    return int(physical_memory() * DEFAULT_SHARE)


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a small machine
        return 8 << 30


def weights_on_disk(path: Path) -> int:
    """The bytes of a model's weights files (what loading them holds in memory, about)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) + sum(p.stat().st_size for p in path.glob("*.gguf"))


class WeightSizes:
    """A model's weights as planned before a load: the files' bytes until it has loaded once, then
    the larger of those and the bytes its parameters held in memory (widened or dequantized
    tensors hold more than the file: Gemma 3 270M's 241 MiB file holds 339 MiB on the native path)."""

    def __init__(self) -> None:
        self._loaded: dict[str, int] = {}
        self._lock = threading.Lock()

    def planned(self, name: str, path: Path) -> int:
        with self._lock:
            known = self._loaded.get(name, 0)
        return max(weights_on_disk(path), known)

    def loaded(self, name: str, parameter_bytes: int) -> None:
        with self._lock:
            self._loaded[name] = parameter_bytes


def release_ram(engines: Iterable[object], nbytes: int) -> int:
    """Evict about `nbytes` from the RAM tiers of `engines` that have one; the bytes evicted."""
    freed = 0
    for engine in engines:
        if freed >= nbytes:
            break
        if isinstance(engine, RamReleasing):
            freed += engine.release_ram(nbytes - freed)
    return freed


def _mb(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


async def plan_kv(budget: MemoryBudget, name: str, engine: ServeEngine, request: GenerateRequest, *, resident: int,
                  kv_per_token: int, context_length: int, in_use: int) -> int:
    """The KV bytes `request` plans for: prompt + max_tokens tokens, at most the context. When
    the whole context fits beside `in_use` bytes, that bound is planned without tokenizing twice;
    raises `MemoryBudgetError` when the request could never fit beside its model (`resident`)."""
    upper = context_length * kv_per_token
    if budget.status(in_use).fits(upper):  # beside what the process measures, where more than planned
        return upper
    prompt = await engine.count_tokens(request)
    tokens = min(context_length, prompt + request.max_tokens)
    if not budget.fits(resident + tokens * kv_per_token):
        raise MemoryBudgetError(budget.refuse_request(name, prompt, tokens - prompt, kv_per_token, resident))
    return tokens * kv_per_token
