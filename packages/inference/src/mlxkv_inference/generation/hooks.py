"""What a generation calls back while it runs: prompt snapshots, checkpoints, prefill progress.

They travel together from whoever owns the caches (the prompt cache, the checkpoint store, a
request's status) to the phases that call them (`PromptPrefill`, `CheckpointSchedule`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.generation.results import CheckpointState

# Called with the prompt's first tokens and caches holding them (or more: trimmable caches).
OnSnapshot = Callable[[Sequence[int], list[LayerCache]], None]
OnCheckpoint = Callable[[CheckpointState], None]
# Called with (tokens prefilled, tokens to prefill): first (0, total), then after every chunk.
PrefillProgress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class GenerationHooks:
    """`on_snapshot(tokens, caches)` at each of the prompt's `snapshot_at` points; `on_checkpoint`
    every `checkpoint_every` produced tokens (0: none); `on_prefill_progress` after each chunk."""

    snapshot_at: Sequence[int] = ()
    on_snapshot: OnSnapshot | None = None
    checkpoint_every: int = 0
    on_checkpoint: OnCheckpoint | None = None
    on_prefill_progress: PrefillProgress | None = None


class HookFields(TypedDict, total=False):
    """`GenerationHooks`' fields as keyword arguments (see `Generation`)."""

    snapshot_at: Sequence[int]
    on_snapshot: OnSnapshot | None
    checkpoint_every: int
    on_checkpoint: OnCheckpoint | None
    on_prefill_progress: PrefillProgress | None


NO_HOOKS = GenerationHooks()


def hooks_from(hooks: GenerationHooks | None, fields: HookFields) -> GenerationHooks:
    """`hooks`, or the hooks `fields` name (one or the other)."""
    if hooks is not None and fields:
        raise ValueError(f"pass hooks or its fields ({', '.join(sorted(fields))}), not both")
    return hooks if hooks is not None else GenerationHooks(**fields)
