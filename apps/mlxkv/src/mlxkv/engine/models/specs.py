"""What the router is given: the registered models, what loading one yields, and its policy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxkv_serve import ServeEngine

DEFAULT_WAIT_S = 300.0  # the longest a load waits for a busy model to become idle before a 503


@dataclass(frozen=True, slots=True)
class BoundAdapter:
    """An adapter bound to a model (`--adapter MODEL:NAME=PATH`, `POST /v1/adapters`): read and
    checked against the model each time it loads."""

    name: str
    path: Path


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A registered model: `source` is a local path or a Hugging Face id (None: the embedded model)."""

    name: str
    source: str | None
    adapters: tuple[BoundAdapter, ...] = ()  # in the order they were bound

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError(f"model name {self.name!r} is empty")

    def adapter_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.adapters)


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


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """How the router keeps models: at most `max_models` loaded, `pinned` ones never unloaded, one
    idle for `ttl_s` unloaded (0: never), a load waiting up to `wait_s` for a busy model to make
    room, `default` serving requests that name no registered model (None: a 404), and clients
    adding adapters from under `adapter_dirs` only (`--adapter-dir`)."""

    max_models: int
    pinned: tuple[str, ...] = ()
    default: str | None = None
    ttl_s: float = 0.0
    wait_s: float = DEFAULT_WAIT_S
    adapter_dirs: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if self.max_models < 1:
            raise ValueError(f"--max-models={self.max_models} must be >= 1")
        if len(self.pinned) > self.max_models:
            raise ValueError(f"{len(self.pinned)} pinned models do not fit in --max-models={self.max_models}")
        if not self.ttl_s >= 0:
            raise ValueError(f"--model-ttl={self.ttl_s} must be >= 0 seconds (0: never)")
        if not self.wait_s >= 0:
            raise ValueError(f"wait_s={self.wait_s} must be >= 0 seconds")

    def check_names(self, names: list[str]) -> None:
        """ValueError when a pinned or default model is not among `names`."""
        for name in (*self.pinned, *([self.default] if self.default else [])):
            if name not in names:
                raise ValueError(f"model {name!r} is not registered (registered: {', '.join(names)})")
