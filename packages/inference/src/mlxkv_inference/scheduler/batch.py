"""Continuous batching: many generations share each step, each token what it would be alone.

    step:  prefill  the prefilling generations with the least prompt left first (the least
                    prefill time left, under a time bound), within the step's token budget;
                    a prompt passed over in MAX_PASSED_OVER steps in a row goes first;
                    a prompt whose rest the step takes whole rides in the decode forward instead
                    (`Generation.join`, up to STEP_MAX_ROWS rows a step): no forward of its own
                    (not one fed in turns before: its last chunk stays a turn an arrival stops)
           decode   one token for every generation past its prefill, as one batched step:
                    stacked rows through every linear, attention per row against its own caches;
                    a generation speculating this step brings its drafts as more rows (its own
                    draft length), and what it accepts changes no other row

While every running generation decodes plain steps (no drafts, no grammar, no prompt waiting),
steps are pipelined: a step's graph is built on the tokens the last step drew, before they are
read, and evaluates while they are taken (`_decode_ahead`); the values are the same, and a
generation that ends on a token in flight drops the one it fed on.

A request that arrives during a step, with a prompt estimated to prefill sooner than the rest of
the one prefilling, stops that prompt's chunk between two layers (`step`'s `arrival`): the
newcomer's prompt goes first in the next step, and the rest of the chunk is evaluated in its
prompt's next turn, to the same values.

Where the model's forward is chunk-invariant (`verifies_positions`: L positions in one forward are
bitwise L single steps), a chunk is cut to the budget left; otherwise a generation's chunks keep
the boundaries it has when run alone. Its batched decode rows are bitwise its lone rows when the
model's matmul kernels are row-invariant (checked once per model; see `native.batched`). Otherwise
each row runs its own graph inside the same step: slower, still exact.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxkv_inference import _mlx_lm
from mlxkv_inference.binding import DEFAULT_PREFILL_CHUNK, Interrupt, MlxAutoregressiveBinding
from mlxkv_inference.generation.generate import Generation, TextDelta

DEFAULT_MAX_BATCH = 8
MIN_TIMED_CHUNK = 8  # the fewest prompt tokens a time-bounded prefill step feeds
WHOLE_STEPS = 2.0  # a prompt's rest estimated within this many step times is fed whole (see `_prefill`)
# Steps in a row a prompt may wait while others prefill before its next chunk comes first (see
# `_prefill`): under a stream of shorter prompts a long one still gets one step in this many + 1.
MAX_PASSED_OVER = 4
# The most rows a batched step may have, prompts riding in it (`join`) and drafts included: the
# row-invariance probe covers them at warm-up (~1 s for the embedded model); a step past it would
# stall every running sequence on a new probe (~3.5 s for 128 rows).
STEP_MAX_ROWS = 64
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


class BatchScheduler:
    """Steps up to `max_batch` generations together on the thread that owns MLX."""

    def __init__(self, binding: MlxAutoregressiveBinding, *, max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_budget: int = DEFAULT_PREFILL_CHUNK, prefill_step_s: float = 0.0, pipelined: bool = True) -> None:
        """`prefill_step_s` > 0: where chunks may be cut, a prompt's chunk is sized from its last
        one's seconds a token (a new prompt's from the latest new prompt's first chunk) so a
        step's prefill takes about that long (a prompt's tokens cost more as its context grows):
        the running generations wait about that for their next token (a request arriving
        meanwhile stops the chunk instead; see `step`). A prompt whose rest fits one chunk and
        `WHOLE_STEPS` step times is fed whole. `pipelined=False`: no step is built before the last
        one's tokens are read (see `_decode_ahead`; the tokens are the same either way)."""
        if max_batch < 1:
            raise ValueError(f"max batch={max_batch} must be >= 1")
        if prefill_budget < 1:
            raise ValueError(f"prefill budget={prefill_budget} must be >= 1 token a step")
        if prefill_step_s < 0:
            raise ValueError(f"prefill step time={prefill_step_s} must be >= 0 seconds (0: no time bound)")
        self.prefill_step_s = prefill_step_s
        self.pipelined = pipelined
        self._token_seconds: dict[int, float] = {}  # generation -> seconds a token of its last chunk
        self._fresh_seconds: float | None = None  # seconds a token of the latest first chunk of an uncached prompt
        self.binding = binding
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self.running: list[Generation] = []
        self.batched_steps = 0  # decode steps that ran stacked rows (the others ran a graph per row)
        self.pipelined_steps = 0  # of those, built before the last step's tokens were read (see `_decode_ahead`)
        self.largest_batch = 0  # the most generations one step has run
        self._steps = 0
        self._prefilled_at: dict[int, int] = {}  # generation -> when it last got a prefill chunk
        self._passed_over: dict[int, int] = {}  # generation -> steps in a row others prefilled and it did not

    @property
    def has_room(self) -> bool:
        return len(self.running) < self.max_batch

    def add(self, generation: Generation) -> tuple[TextDelta, ...]:
        """Start `generation` in the next step; returns the text a resumed one replays."""
        if not self.has_room:
            raise ValueError(f"the batch is full ({self.max_batch} generations); wait for one to finish")
        replay = tuple(generation.start())
        self.running.append(generation)
        return replay

    def step(self, arrival: Arrival | None = None) -> list[StepOutcome]:
        """One scheduler step over the running generations (see the module docstring).

        `arrival()` gives the prompt tokens of a request the caller would start once this step
        returns (None: none waits). Asked between the layers of a prefill chunk: where the
        newcomer's prefill is estimated shorter than the rest of the prompt prefilling (the order
        the next step would run them in), the step's prefill ends there (the rest of the chunk is
        evaluated in that prompt's next turn; see `evaluate_layers`), so the newcomer waits for a
        layer and this step's decode rows, not for a whole chunk. (A prompt riding in the decode
        forward, `Generation.join`, is part of those rows: at most `STEP_MAX_ROWS` of them.)"""
        self.largest_batch = max(self.largest_batch, len(self.running))
        outcomes: dict[int, StepOutcome] = {}
        for generation in self.running:
            if generation.cancelled and not generation.done:  # also mid-prefill: finish() ends it cancelled
                outcomes[id(generation)] = StepOutcome(generation, (), True)
        read: dict[int, tuple[TextDelta, ...]] = {}
        feeding = self._pipelined(outcomes, arrival)
        if feeding:
            self._decode_ahead(feeding, outcomes)
        else:
            self._read_in_flight(read, outcomes)
            self._prefill(outcomes, arrival)
            ready = [g for g in self.running if id(g) not in outcomes and not g.done and not g.prefilling]
            self._decode(ready, outcomes)
        for generation in self.running:
            if id(generation) not in outcomes and (generation.done or id(generation) in read):
                outcomes[id(generation)] = StepOutcome(generation, (), False)
        result = []
        for generation in list(self.running):
            outcome = outcomes.get(id(generation))
            if outcome is None:
                continue
            if id(generation) in read:
                outcome = StepOutcome(generation, read[id(generation)] + outcome.deltas, outcome.finished, outcome.error)
            if outcome.error is None and (generation.done or outcome.finished):
                outcome = StepOutcome(generation, outcome.deltas, True, tail=tuple(generation.finish()))
            if outcome.finished or outcome.error is not None:
                self.running.remove(generation)
                self._prefilled_at.pop(id(generation), None)
                self._passed_over.pop(id(generation), None)
                self._token_seconds.pop(id(generation), None)
            result.append(outcome)
        return result

    def _pipelined(self, outcomes: dict[int, StepOutcome], arrival: Arrival | None) -> list[Generation]:
        """The generations this step feeds pipelined (empty: a step as above): where every
        running generation is decoding, none waits to start, and each either may feed its next
        token before the one in flight is read (`Generation.runs_ahead`) or ends on that one."""
        running = self.running
        if not self.pipelined or outcomes or len(running) < 2 or any(g.prefilling or not g.needs_step for g in running):
            return []
        if arrival is not None and arrival() is not None:
            return []
        feeding = [g for g in running if g.runs_ahead(len(running))]
        if len(feeding) < 2 or any(g not in feeding and not g.ahead_ends for g in running):
            return []
        return feeding if self.binding.can_decode_batch([g.caches for g in feeding]) else []

    def _decode_ahead(self, feeding: Sequence[Generation], outcomes: dict[int, StepOutcome]) -> None:
        """A pipelined decode step: build the step after the one in flight, each row fed the
        token its last step drew (not read yet), start evaluating it, then read the tokens in
        flight. The graph (~7 ms of Python at eight rows) is built while the last step's last
        layers evaluate, and its own first layers run while the rest is built (MLX returns from
        an eval only once all but ~100 of its dispatches are submitted: `decode_batch` dispatches
        every few layers); `tools.bench_batch`: 1.13x the unpipelined tok/s on this 2-core
        machine (1.0-1.2x before that dispatching, mostly ~1.02x). A generation starting gets
        its first token from this step in the next one; one whose read ends it drops the token
        it fed on (`Generation.read_ahead`)."""
        reading = [g for g in self.running if g.in_flight]
        try:
            tokens = mx.concatenate([g.ahead_input(len(self.running)) for g in feeding])
            logits = self.binding.decode_batch(tokens, [g.caches for g in feeding])
            _mlx_lm.async_eval(*[a for i, g in enumerate(feeding) for a in g.draw_ahead(logits[i : i + 1])])
        except Exception as e:  # noqa: BLE001 - the rows fed shared the step: each of them failed
            for generation in feeding:
                outcomes[id(generation)] = StepOutcome(generation, (), False, e)
            reading = [g for g in reading if g not in feeding]  # a row ending on its token in flight ends
        else:
            self.batched_steps += 1
            self.pipelined_steps += 1
        for generation in reading:
            try:
                outcomes[id(generation)] = StepOutcome(generation, tuple(generation.read_ahead()), False)
            except Exception as e:  # noqa: BLE001 - one failed generation must not stop the others
                outcomes[id(generation)] = StepOutcome(generation, (), False, e)

    def _read_in_flight(self, read: dict[int, tuple[TextDelta, ...]], outcomes: dict[int, StepOutcome]) -> None:
        """Read the tokens the last (pipelined) step left in flight, before a step that is not
        pipelined (a cancelled generation's are dropped by its `finish`)."""
        for generation in self.running:
            if not generation.in_flight or id(generation) in outcomes:
                continue
            deltas: list[TextDelta] = []
            try:
                while generation.in_flight and not generation.done:
                    deltas.extend(generation.read_ahead())
            except Exception as e:  # noqa: BLE001 - one failed generation must not stop the others
                outcomes[id(generation)] = StepOutcome(generation, (), False, e)
            else:
                read[id(generation)] = tuple(deltas)

    def _prefill(self, outcomes: dict[int, StepOutcome], arrival: Arrival | None) -> None:
        """Prefill the generations with the least prompt left first (ties: the one served
        longest ago), so a short prompt arriving behind a long one gets its first token in the
        next step. Once a prompt is complete, the step runs only prompts that complete within
        the budget left: the others wait a step rather than delay the new first token.

        With a time bound the order is the least prefill time left (a token costs more the
        deeper its context: the tail of a long prompt can outlast a whole new short one), and
        the bound is the step's: a turn gets the time the turns before it left, if that affords
        a timed chunk.

        That order alone would starve a long prompt while shorter ones keep arriving; one passed
        over in `MAX_PASSED_OVER` steps in a row goes first (of several, the longest passed over;
        see `_starvation`), and no arrival stops its chunk."""
        budget = self.prefill_budget
        waiting = [g for g in self.running if id(g) not in outcomes and g.prefilling]
        splittable = bool(waiting) and self.binding.verifies_positions()
        timed = splittable and self.prefill_step_s > 0
        deadline = time.perf_counter() + self.prefill_step_s
        completed, turns = False, 0
        served: set[int] = set()  # generations given a turn this step
        for generation in sorted(waiting, key=lambda g: (*self._starvation(g), *self._prefill_order(g, timed))):
            take = min(generation.prefill_chunk, budget) if splittable else generation.prefill_chunk
            if budget <= 0 or (completed and (generation.prefill_left > budget or generation.unevaluated)):
                break
            starved = self._starved(generation)
            interrupt = None if arrival is None or starved else self._sooner_arrival(arrival, generation, timed)
            if generation.unevaluated:  # an interrupt stopped its last chunk: that comes first, untimed
                turns += 1
                served.add(id(generation))
                owed = generation.unevaluated
                try:
                    if not generation.finish_chunk(interrupt):
                        break
                except Exception as e:  # noqa: BLE001 - one failed generation must not stop the others
                    outcomes[id(generation)] = StepOutcome(generation, (), False, e)
                    continue
                budget -= owed  # the step's token bound counts the tokens evaluated in it
                if budget <= 0:
                    break
                take = min(generation.prefill_chunk, budget) if splittable else generation.prefill_chunk
            seconds: float | None = None
            if timed:
                seconds, left_s = self._token_seconds_of(generation, take), deadline - time.perf_counter()
                if seconds is not None:
                    # A prompt whose rest fits one chunk and about one step's time is not cut:
                    # cutting only delays its own first token by a step (measured: a 35-token
                    # prompt cut 19 + 15 got it ~40 ms later). The deep tail of a long prompt is.
                    # Within two step times, not one and a half: a 35-token prompt arriving
                    # during a long prefill measured ~150 ms under `mlxkv serve`'s load here, so
                    # at 1.5 one in five was cut, ~0.1 s more to its first token (the p99; in that
                    # run a long prompt's last chunk, joined then, also set the estimate: `_joins`).
                    left = generation.prefill_left
                    whole = left <= generation.prefill_chunk and left * seconds <= WHOLE_STEPS * self.prefill_step_s
                    least = left if whole else MIN_TIMED_CHUNK
                    if turns and left_s < least * seconds:  # the step's first turn always runs
                        break
                    if not whole:
                        take = min(take, max(MIN_TIMED_CHUNK, int(left_s / seconds)))
            turns += 1
            served.add(id(generation))
            self._steps += 1
            self._prefilled_at[id(generation)] = self._steps
            left = generation.prefill_left
            if take >= left and self._joins(generation, outcomes):
                generation.join()  # its prompt rides in the decode forward: no forward of its own
                budget -= left
                deadline -= left * seconds if seconds is not None else 0.0  # the time it will take there
                completed = True
                continue
            started = time.perf_counter()
            try:
                fed = self._prefill_turn(generation, take, splittable, interrupt)
            except Exception as e:  # noqa: BLE001 - one failed generation must not stop the others
                outcomes[id(generation)] = StepOutcome(generation, (), False, e)
                continue
            budget -= fed
            if interrupt is not None and interrupt():  # the turn may have stopped mid-chunk: not timed
                break
            if fed:
                measured = (time.perf_counter() - started) / fed
                if id(generation) not in self._token_seconds and not generation.cached_tokens:
                    self._fresh_seconds = measured
                self._token_seconds[id(generation)] = measured
            completed = completed or not generation.prefilling
        for generation in waiting:
            passed = turns > 0 and id(generation) not in served
            self._passed_over[id(generation)] = (self._passed_over.get(id(generation), 0) + 1) if passed else 0

    def _joins(self, generation: Generation, outcomes: dict[int, StepOutcome]) -> bool:
        """Whether `generation`'s prompt rest, taken whole this step, rides in the decode forward
        (`Generation.join`): it may (`can_join`), and the step, with the prompts joined already,
        stays within `STEP_MAX_ROWS` rows that run batched exactly (a row for each stepping
        generation and for each other prompt that may still complete this step; `_decode` cuts
        the drafts to the room left).

        A prompt fed in turns before (a long one) ends with a turn too: a decode step cannot stop
        between layers for a request arriving during it, and a long prompt's last chunk, deep in
        its context, is dear (measured: a 2,000-token prompt's last 21-24 tokens took ~0.21 s in
        the decode step, and short requests arriving then waited it out, the p99 of their first
        token). Its first token comes a step later, which at its length costs it nothing much."""
        if id(generation) in self._token_seconds:
            return False
        rows = generation.prefill_left + 1
        steppers = [g for g in self.running if id(g) not in outcomes and not g.done and not g.prefilling]
        rows += sum(g.joining_rows or 1 for g in steppers)
        rows += sum(1 for g in self.running if g.prefilling and g is not generation and id(g) not in outcomes)
        if rows > STEP_MAX_ROWS or not generation.can_join(STEP_MAX_ROWS):
            return False
        return self.binding.can_decode_batch([g.caches for g in steppers] + [generation.caches], rows)

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
        starved prompt, see `_prefill`, still goes before both)."""

        def interrupt() -> bool:
            tokens = arrival()
            if tokens is None:
                return False
            left = _tokens_left(generation)
            if timed:
                theirs = self._unmeasured_seconds(min(tokens, self.prefill_budget), fresh=True)
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
        if fresh and self._fresh_seconds is not None:
            return self._fresh_seconds
        positions = max(positions, 1)
        forward = self.binding.step_costs.seconds(positions)
        return forward / positions if forward else None

    @staticmethod
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

    def _decode(self, ready: Sequence[Generation], outcomes: dict[int, StepOutcome]) -> None:
        stepping = [g for g in ready if g.needs_step]
        for generation in (g for g in ready if not g.needs_step):  # a resumed generation's pending token
            outcomes[id(generation)] = StepOutcome(generation, tuple(generation.accept(None)), False)
        shared = len(stepping) > 1 and self.binding.can_decode_batch([g.caches for g in stepping])
        inputs: list[mx.array] = []
        rows = 0
        least = [g.joining_rows or 1 for g in stepping]  # a joined prompt's rows, else its pending token
        joined = any(g.joining_rows for g in stepping)
        for i, generation in enumerate(stepping):
            # The step's rows besides this generation's drafts: what the ones before it chose,
            # the least of this one and of each after it. (Each judging its drafts against a step
            # of one row per generation, all eight of a batch drafted, and the 16-row step cost
            # what none expected.) A batched step keeps within the rows probed for it.
            others = rows + sum(least[i:]) if shared else 1
            most = max(STEP_MAX_ROWS - others, 0) if shared or joined else None
            inputs.append(generation.step_input(others, len(stepping) if shared else 1, most))
            rows += int(inputs[-1].size)
        if (len(stepping) > 1 or joined) and self.binding.can_decode_batch([g.caches for g in stepping], rows):
            self._decode_batched(stepping, inputs, outcomes)
            return
        for generation, tokens in zip(stepping, inputs):
            try:
                deltas = generation.accept(generation.decode_alone(tokens))
            except Exception as e:  # noqa: BLE001 - one failed generation must not stop the others
                outcomes[id(generation)] = StepOutcome(generation, (), False, e)
            else:
                outcomes[id(generation)] = StepOutcome(generation, tuple(deltas), False)

    def _decode_batched(self, stepping: Sequence[Generation], inputs: Sequence[mx.array],
                        outcomes: dict[int, StepOutcome]) -> None:
        started = time.perf_counter()
        lengths = [int(t.size) for t in inputs]
        wanted = [g.logit_rows for g in stepping]  # a joined prompt's last position, every other row
        try:
            logits = self.binding.decode_batch(mx.concatenate(list(inputs)), [g.caches for g in stepping], lengths, wanted)
            ends = list(itertools.accumulate(wanted))
            own = [logits[end - n : end] for n, end in zip(wanted, ends)]  # each generation's rows
            mx.eval([a for generation, rows in zip(stepping, own) for a in generation.draw(rows)])  # every plain row at once
            accepted = [generation.accept(rows) for generation, rows in zip(stepping, own)]
        except Exception as e:  # noqa: BLE001 - the rows shared the step: each of them failed
            for generation in stepping:
                outcomes[id(generation)] = StepOutcome(generation, (), False, e)
            return
        self.batched_steps += 1
        seconds = time.perf_counter() - started
        if wanted == lengths:
            self.binding.step_costs.record(sum(lengths), seconds)
        elif any(n < length and not g.cached_tokens for g, n, length in zip(stepping, wanted, lengths)):
            # A new prompt's only chunk was this step (no head on its positions, unlike the
            # forwards step costs time; a prompt fed in turns before does not join, see
            # `_joins`): what the next new prompt's tokens are estimated at.
            self._fresh_seconds = seconds / sum(lengths)
        for generation, deltas in zip(stepping, accepted):
            outcomes[id(generation)] = StepOutcome(generation, tuple(deltas), False)


def _tokens_left(generation: Generation) -> int:
    """The prompt tokens `generation` has to feed or to evaluate (at most: some layers of a
    stopped chunk are done)."""
    return generation.prefill_left + generation.unevaluated
