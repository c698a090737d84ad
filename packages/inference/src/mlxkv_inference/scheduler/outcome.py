"""What one scheduler step did for one generation, and what a step asks of the caller."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.generation.results import TextDelta

Arrival = Callable[[], int | None]  # the prompt tokens of a request waiting to start after this step (None: none)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one step did for one generation: its new text (one delta per token), and whether it
    ended (its `result` is then set, and `tail` holds the text held back until the end) or failed
    (`error`; the generation is dropped)."""

    generation: Generation
    deltas: tuple[TextDelta, ...]
    finished: bool
    error: Exception | None = None
    tail: tuple[TextDelta, ...] = ()


Outcomes = dict[int, StepOutcome]  # id(generation) -> its outcome so far this step


def failed(outcomes: Outcomes, generations: list[Generation] | tuple[Generation, ...], error: Exception) -> None:
    """Record that `generations` failed this step with `error` (they are dropped)."""
    for generation in generations:
        outcomes[id(generation)] = StepOutcome(generation, (), False, error)
