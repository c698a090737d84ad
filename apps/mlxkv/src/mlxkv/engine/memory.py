"""The memory budget: the bytes loaded models (weights and RAM prompt tier) and the running
requests' planned KV may hold together, so that work which does not fit is refused or waits
instead of growing until the kernel kills the process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mlxkv_serve import GenerateRequest, ModelUnavailableError, ServeEngine

# What the default leaves to the OS, other processes and what the budget does not count
# (activations, the tokenizer, Python): a quarter of the machine.
DEFAULT_SHARE = 0.75
LIVE = ("queued", "running")  # a generation's status while its KV is planned


class MemoryBudgetError(ValueError):
    """A request whose planned KV cannot fit in the budget even alone (a 400: ask for less)."""


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    limit_bytes: int

    def __post_init__(self) -> None:
        if self.limit_bytes < 1:
            raise ValueError(f"memory budget={self.limit_bytes} bytes must be >= 1")

    def fits(self, total_bytes: int) -> bool:
        return total_bytes <= self.limit_bytes

    def refuse_model(self, name: str, need: int, resident: int) -> ModelUnavailableError:
        other = f"; pinned or busy models hold {_mb(resident)}" if resident else ""
        return ModelUnavailableError(f"the model {name!r} needs about {_mb(need)} (weights and RAM prompt cache) and the "
                                     f"memory budget is {_mb(self.limit_bytes)} (--memory-budget){other}")

    def check_model(self, name: str, weights: int, ram_cache: int) -> None:
        """Raise ValueError (at start-up, one model) when `name` cannot fit at all."""
        if not self.fits(weights + ram_cache):
            raise ValueError(f"the model {name!r} needs about {_mb(weights)} of weights and {_mb(ram_cache)} of RAM prompt "
                             f"cache (--prompt-cache-bytes) and the memory budget is {_mb(self.limit_bytes)} (--memory-budget)")

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


def _mb(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


async def plan_kv(budget: MemoryBudget, name: str, engine: ServeEngine, request: GenerateRequest, *, resident: int,
                  kv_per_token: int, context_length: int, in_use: int) -> int:
    """The KV bytes `request` plans for: prompt + max_tokens tokens, at most the context. When
    the whole context fits beside `in_use` bytes, that bound is planned without tokenizing twice;
    raises `MemoryBudgetError` when the request could never fit beside its model (`resident`)."""
    upper = context_length * kv_per_token
    if budget.fits(in_use + upper):
        return upper
    prompt = await engine.count_tokens(request)
    tokens = min(context_length, prompt + request.max_tokens)
    if not budget.fits(resident + tokens * kv_per_token):
        raise MemoryBudgetError(budget.refuse_request(name, prompt, tokens - prompt, kv_per_token, resident))
    return tokens * kv_per_token
