"""Which prompts prefill in a step, and how much of each.

The prefilling generations with the least prompt left go first (the least prefill time left,
under a time bound), within the step's token budget; a prompt passed over in MAX_PASSED_OVER
steps in a row goes first. A prompt whose rest the step takes whole rides in the decode forward
instead (`Generation.join`): no forward of its own (not one fed in turns before: its last chunk
stays a turn an arrival stops).

A request that arrives during a step, with a prompt estimated to prefill sooner than the rest of
the one prefilling, stops that prompt's chunk between two layers: the newcomer's prompt goes
first in the next step, and the rest of the chunk is evaluated in its prompt's next turn, to the
same values.

Where the model's forward is chunk-invariant (`verifies_positions`: L positions in one forward are
bitwise L single steps), a chunk is cut to the budget left; otherwise a generation's chunks keep
the boundaries it has when run alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from mlxkv_inference.binding import Interrupt, MlxAutoregressiveBinding
from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.scheduler.decode_step import STEP_MAX_ROWS
from mlxkv_inference.scheduler.outcome import Arrival, Outcomes, failed

MIN_TIMED_CHUNK = 8  # the fewest prompt tokens a time-bounded prefill step feeds
WHOLE_STEPS = 2.0  # a prompt's rest estimated within this many step times is fed whole (see `_timed_take`)
# Steps in a row a prompt may wait while others prefill before its next chunk comes first: under a
# stream of shorter prompts a long one still gets one step in this many + 1.
MAX_PASSED_OVER = 4


@dataclass(slots=True)
class _StepPrefill:
    """Where one step's prefill stands: the tokens and time left, and the turns given."""

    budget: int
    deadline: float
    splittable: bool  # chunks may be cut to the budget left
    timed: bool
    completed: bool = False  # a prompt completed this step
    turns: int = 0
    served: set[int] = field(default_factory=set)  # generations given a turn

    def serve(self, generation: Generation) -> None:
        self.turns += 1
        self.served.add(id(generation))

    def take(self, generation: Generation) -> int:
        return min(generation.prefill_chunk, self.budget) if self.splittable else generation.prefill_chunk


class PrefillPlanner:
    """Runs each step's prefill turns and keeps what it learns across steps: each prompt's
    seconds a token, when it last got a turn, and how many steps in a row it was passed over."""

    def __init__(self, binding: MlxAutoregressiveBinding, budget: int, step_s: float) -> None:
        self._binding = binding
        self._budget = budget
        self._step_s = step_s
        self._token_seconds: dict[int, float] = {}  # generation -> seconds a token of its last chunk
        self.fresh_seconds: float | None = None  # seconds a token of the latest first chunk of an uncached prompt
        self._steps = 0
        self._prefilled_at: dict[int, int] = {}  # generation -> when it last got a prefill chunk
        self._passed_over: dict[int, int] = {}  # generation -> steps in a row others prefilled and it did not

    def forget(self, generation: Generation) -> None:
        """`generation` left the batch."""
        for known in (self._prefilled_at, self._passed_over, self._token_seconds):
            known.pop(id(generation), None)

    def prefill(self, running: Sequence[Generation], outcomes: Outcomes, arrival: Arrival | None) -> None:
        """Prefill the generations with the least prompt left first (ties: the one served
        longest ago), so a short prompt arriving behind a long one gets its first token in the
        next step. Once a prompt is complete, the step runs only prompts that complete within
        the budget left: the others wait a step rather than delay the new first token.

        With a time bound the order is the least prefill time left (a token costs more the
        deeper its context: the tail of a long prompt can outlast a whole new short one), and
        the bound is the step's: a turn gets the time the turns before it left, if that affords
        a timed chunk. A prompt passed over in `MAX_PASSED_OVER` steps in a row goes first (of
        several, the longest passed over; see `_starvation`), and no arrival stops its chunk."""
        waiting = [g for g in running if id(g) not in outcomes and g.prefilling]
        splittable = bool(waiting) and self._binding.verifies_positions()
        step = _StepPrefill(self._budget, time.perf_counter() + self._step_s, splittable, splittable and self._step_s > 0)
        for generation in sorted(waiting, key=lambda g: (*self._starvation(g), *self._prefill_order(g, step.timed))):
            if not self._turn(generation, step, running, outcomes, arrival):
                break
        for generation in waiting:
            passed = step.turns > 0 and id(generation) not in step.served
            self._passed_over[id(generation)] = (self._passed_over.get(id(generation), 0) + 1) if passed else 0

    def _turn(self, generation: Generation, step: _StepPrefill, running: Sequence[Generation], outcomes: Outcomes,
              arrival: Arrival | None) -> bool:
        """Give `generation` its turn this step; whether the step's prefill goes on."""
        take = step.take(generation)
        if step.budget <= 0 or (step.completed and (generation.prefill_left > step.budget or generation.unevaluated)):
            return False
        starved = self._starved(generation)
        interrupt = None if arrival is None or starved else self._sooner_arrival(arrival, generation, step.timed)
        if generation.unevaluated:  # an interrupt stopped its last chunk: that comes first, untimed
            step.serve(generation)
            owed = generation.unevaluated
            try:
                if not generation.finish_chunk(interrupt):
                    return False
            except Exception as e:  # noqa: BLE001 - one failed generation must not stop the others
                failed(outcomes, [generation], e)
                return True
            step.budget -= owed  # the step's token bound counts the tokens evaluated in it
            if step.budget <= 0:
                return False
            take = step.take(generation)
        seconds = self._token_seconds_of(generation, take) if step.timed else None
        if seconds is not None:
            timed_take = self._timed_take(generation, take, seconds, step)
            if timed_take is None:
                return False
            take = timed_take
        step.serve(generation)
        self._steps += 1
        self._prefilled_at[id(generation)] = self._steps
        left = generation.prefill_left
        if take >= left and self._joins(generation, running, outcomes):
            generation.join()  # its prompt rides in the decode forward: no forward of its own
            step.budget -= left
            step.deadline -= left * seconds if seconds is not None else 0.0  # the time it will take there
            step.completed = True
            return True
        return self._feed(generation, take, step, interrupt, outcomes)

    def _timed_take(self, generation: Generation, take: int, seconds: float, step: _StepPrefill) -> int | None:
        """The tokens a turn feeds in the time the step has left (None: none; the step's first
        turn always runs). A prompt whose rest fits one chunk and `WHOLE_STEPS` step times is
        not cut: cutting it only delays its own first token by a step; the deep tail of a long
        prompt is."""
        left_s = step.deadline - time.perf_counter()
        left = generation.prefill_left
        whole = left <= generation.prefill_chunk and left * seconds <= WHOLE_STEPS * self._step_s
        least = left if whole else MIN_TIMED_CHUNK
        if step.turns and left_s < least * seconds:
            return None
        return take if whole else min(take, max(MIN_TIMED_CHUNK, int(left_s / seconds)))

    def _feed(self, generation: Generation, take: int, step: _StepPrefill, interrupt: Interrupt | None,
              outcomes: Outcomes) -> bool:
        """Feed a prompt's turn and time it; whether the step's prefill goes on."""
        started = time.perf_counter()
        try:
            fed = _prefill_turn(generation, take, step.splittable, interrupt)
        except Exception as e:  # noqa: BLE001 - one failed generation must not stop the others
            failed(outcomes, [generation], e)
            return True
        step.budget -= fed
        if interrupt is not None and interrupt():  # the turn may have stopped mid-chunk: not timed
            return False
        if fed:
            measured = (time.perf_counter() - started) / fed
            if id(generation) not in self._token_seconds and not generation.cached_tokens:
                self.fresh_seconds = measured
            self._token_seconds[id(generation)] = measured
        step.completed = step.completed or not generation.prefilling
        return True

    def _joins(self, generation: Generation, running: Sequence[Generation], outcomes: Outcomes) -> bool:
        """Whether `generation`'s prompt rest, taken whole this step, rides in the decode forward
        (`Generation.join`): it may (`can_join`), and the step, with the prompts joined already,
        stays within `STEP_MAX_ROWS` rows that run batched exactly (a row for each stepping
        generation and for each other prompt that may still complete this step; the decode step
        cuts the drafts to the room left). A prompt fed in turns before (a long one) ends with a
        turn too: a decode step cannot stop between layers for an arrival, and a long prompt's
        last chunk, deep in its context, is dear."""
        if id(generation) in self._token_seconds:
            return False
        rows = generation.prefill_left + 1
        steppers = [g for g in running if id(g) not in outcomes and not g.done and not g.prefilling]
        rows += sum(g.joining_rows or 1 for g in steppers)
        rows += sum(1 for g in running if g.prefilling and g is not generation and id(g) not in outcomes)
        if rows > STEP_MAX_ROWS or not generation.can_join(STEP_MAX_ROWS):
            return False
        return self._binding.can_decode_batch([g.caches for g in steppers] + [generation.caches], rows)

    def _starved(self, generation: Generation) -> bool:
        return self._passed_over.get(id(generation), 0) >= MAX_PASSED_OVER

    def _starvation(self, generation: Generation) -> tuple[bool, int]:
        """Sorts starved generations first, the longest passed over first (a starved short prompt
        must not keep a starved long one waiting: once it completes, the step stops at the long
        one), the others as equals."""
        starved = self._starved(generation)
        return not starved, -self._passed_over[id(generation)] if starved else 0

    def _sooner_arrival(self, arrival: Arrival, generation: Generation, timed: bool) -> Interrupt:
        """Whether a newcomer would go before the rest of `generation`'s prefill in the next
        step by `_prefill_order`'s measure (estimated time where steps are timed, else tokens; a
        starved prompt still goes before both)."""

        def interrupt() -> bool:
            tokens = arrival()
            if tokens is None:
                return False
            left = _tokens_left(generation)
            if timed:
                theirs = self._unmeasured_seconds(min(tokens, self._budget), fresh=True)
                mine = self._token_seconds_of(generation, left)
                if theirs is not None and mine is not None:
                    return tokens * theirs < left * mine
            return tokens < left

        return interrupt

    def _prefill_order(self, generation: Generation, timed: bool) -> tuple[float, int, int]:
        left = _tokens_left(generation)
        seconds = self._token_seconds_of(generation, left) if timed else None
        return (left * seconds if seconds is not None else 0.0, left, self._prefilled_at.get(id(generation), -1))

    def _token_seconds_of(self, generation: Generation, tokens: int) -> float | None:
        """Seconds a prompt token of `generation` costs: its last chunk's; else (no chunk yet) the
        latest uncached prompt's first chunk's (the same shallow context, this machine's current
        speed); else a forward of `tokens` positions' share by the binding's step costs (None
        before any)."""
        seconds = self._token_seconds.get(id(generation))
        if seconds is not None:
            return seconds
        return self._unmeasured_seconds(min(tokens, generation.prefill_chunk), fresh=not generation.cached_tokens)

    def _unmeasured_seconds(self, positions: int, fresh: bool) -> float | None:
        """Seconds a token costs of a prompt with no chunk timed yet (one not started, too): for
        a `fresh` (uncached) one the latest uncached prompt's first chunk's, where there was one;
        else a forward of `positions` positions' share by the binding's step costs (None before
        any)."""
        if fresh and self.fresh_seconds is not None:
            return self.fresh_seconds
        positions = max(positions, 1)
        forward = self._binding.step_costs.seconds(positions)
        return forward / positions if forward else None


def _prefill_turn(generation: Generation, take: int, splittable: bool, interrupt: Interrupt | None) -> int:
    """Feed up to `take` prompt tokens of `generation`, on through the snapshot points its
    prefill stops at (so a short prompt completes in one step, not one step a point); returns
    how many were fed. Where chunks may not be cut, every call is a whole chunk from where the
    last one stopped: the boundaries of a lone run, whose chunks also restart at each point.
    An `interrupt` ends the turn (the chunk it stopped counts as fed)."""
    fed = 0
    while generation.prefilling and fed < take:
        got = generation.prefill(take - fed if splittable else take, interrupt)
        fed += got
        if not got or (interrupt is not None and interrupt()):
            break
    return fed


def _tokens_left(generation: Generation) -> int:
    """The prompt tokens `generation` has to feed or to evaluate (at most: some layers of a
    stopped chunk are done)."""
    return generation.prefill_left + generation.unevaluated
