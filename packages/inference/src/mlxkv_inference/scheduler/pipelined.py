"""Pipelined decode steps: while every running generation decodes plain steps (no drafts, no
grammar, no prompt waiting), a step's graph is built on the tokens the last step drew, before
they are read, and evaluates while they are taken. The values are the same; a generation that
ends on a token in flight drops the one it fed on (`RunAhead.land`)."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlxkv_inference import _mlx_lm
from mlxkv_inference.binding import MlxAutoregressiveBinding
from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.generation.results import TextDelta
from mlxkv_inference.scheduler.outcome import Arrival, Outcomes, StepOutcome, failed


def pipelined_rows(binding: MlxAutoregressiveBinding, running: Sequence[Generation], outcomes: Outcomes,
                   arrival: Arrival | None) -> list[Generation]:
    """The generations this step feeds pipelined (empty: a step that is not): where every
    running generation is decoding, none waits to start, and each either may feed its next
    token before the one in flight is read (`RunAhead.may_run`) or ends on that one."""
    if outcomes or len(running) < 2 or any(g.prefilling or not g.needs_step for g in running):
        return []
    if arrival is not None and arrival() is not None:
        return []
    feeding = [g for g in running if g.ahead.may_run(len(running))]  # each needs_step (above)
    if len(feeding) < 2 or any(g not in feeding and not g.ahead_ends for g in running):
        return []
    return feeding if binding.can_decode_batch([g.caches for g in feeding]) else []


def decode_ahead(binding: MlxAutoregressiveBinding, running: Sequence[Generation], feeding: Sequence[Generation],
                 outcomes: Outcomes) -> bool:
    """A pipelined decode step: build the step after the one in flight, each row fed the token
    its last step drew (not read yet), start evaluating it, then read the tokens in flight; the
    graph is built while the last step's last layers evaluate. A generation starting gets its
    first token from this step in the next one. Whether the step ran."""
    reading = [g for g in running if g.in_flight]
    ran = True
    try:
        tokens = mx.concatenate([g.ahead.input(len(running)) for g in feeding])
        logits = binding.decode_batch(tokens, [g.caches for g in feeding])
        _mlx_lm.async_eval(*[a for i, g in enumerate(feeding) for a in g.ahead.draw(logits[i : i + 1])])
    except Exception as e:  # noqa: BLE001 - the rows fed shared the step: each of them failed
        failed(outcomes, list(feeding), e)
        reading = [g for g in reading if g not in feeding]  # a row ending on its token in flight ends
        ran = False
    for generation in reading:
        try:
            outcomes[id(generation)] = StepOutcome(generation, tuple(generation.ahead.read()), False)
        except Exception as e:  # noqa: BLE001 - one failed generation must not stop the others
            failed(outcomes, [generation], e)
    return ran


def read_in_flight(running: Sequence[Generation], outcomes: Outcomes) -> dict[int, tuple[TextDelta, ...]]:
    """Read the tokens the last (pipelined) step left in flight, before a step that is not
    pipelined (a cancelled generation's are dropped by its `finish`): id -> the text read."""
    read: dict[int, tuple[TextDelta, ...]] = {}
    for generation in running:
        if not generation.in_flight or id(generation) in outcomes:
            continue
        deltas: list[TextDelta] = []
        try:
            while generation.in_flight and not generation.done:
                deltas.extend(generation.ahead.read())
        except Exception as e:  # noqa: BLE001 - one failed generation must not stop the others
            failed(outcomes, [generation], e)
        else:
            read[id(generation)] = tuple(deltas)
    return read
