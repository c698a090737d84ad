"""The `CompiledDecodeCache` contract every cache class implements.

A cache declares a stable storage identity (`signature()`), how far it can be trimmed, and how
the compiled decode step drives it:

    plan = cache.prepare_decode_step(rows)  # eager: grow/rotate buffers, pick the write index
    stand_in = cache.decode_stand_in(plan)  # what the model sees as its cache inside the compiled step
    stand_in.bind(cache.decode_inputs(plan))  # per-step arrays: buffers, RoPE offset, write index
    ...
    ... model(tokens, cache=stand_ins) ...  # traced once per (signatures, phases, rows, shapes)
    cache.commit_decode_step(plan, stand_in.outputs())

A cache that cannot say what it is is never persisted or routed by guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import mlx.core as mx

DecodePhase = Literal["concat", "ring"]


class CacheTrimError(ValueError):
    """A trim the cache cannot honour (wrapped ring, quantized prefix, recurrent state)."""


class CompiledStepUnsupported(RuntimeError):
    """The model asked a decode stand-in for something the compiled step cannot express; the
    generation falls back to the ordinary graph."""


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """One decode step of one cache: its `rows` tokens land from `write_index` on in a
    `capacity` buffer (more than one: a speculative round's positions)."""

    phase: DecodePhase
    capacity: int
    write_index: int
    offset: int
    rows: int = 1


@runtime_checkable
class DecodeStandIn(Protocol):
    """A cache stand-in the model updates inside the compiled step (array offsets, fixed shapes)."""

    @property
    def num_outputs(self) -> int:
        """How many arrays `outputs()` returns (the cache's new buffers)."""
        ...

    def bind(self, inputs: list[mx.array]) -> None: ...

    def outputs(self) -> list[mx.array]: ...


@runtime_checkable
class CompiledDecodeCache(Protocol):
    offset: int

    @property
    def minimum_reusable_offset(self) -> int:
        """No reuse may trim this cache below this many tokens."""
        ...

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int, bypass: bool = False) -> int:
        """Drop the last `n` tokens; returns how many were dropped. Raises `CacheTrimError`."""
        ...

    def bytes_per_token(self) -> int: ...

    def signature(self) -> str: ...

    def decode_phase(self) -> DecodePhase: ...

    def prepare_decode_step(self, rows: int = 1) -> DecodePlan | None:
        """Make room for `rows` tokens; None when the step cannot run compiled (an empty cache,
        or more rows than this kind's compiled step feeds: only plain caches take several)."""
        ...

    def decode_stand_in(self, plan: DecodePlan) -> DecodeStandIn: ...

    def decode_inputs(self, plan: DecodePlan) -> list[mx.array]: ...

    def commit_decode_step(self, plan: DecodePlan, outputs: list[mx.array]) -> None: ...

    @property
    def state(self) -> Any: ...

    def dispose(self) -> None: ...
