"""Continuous batching: many generations share each step, each token what it would be alone.

    step:  prefill  the prompts the planner picks, within the step's token (and time) budget;
                    a prompt whose rest the step takes whole rides in the decode forward
                    (`Generation.join`)                                   (prefill_plan.py)
           decode   one token for every generation past its prefill, as one batched step:
                    stacked rows through every linear, attention per row against its own
                    caches; drafts of a speculative round as more rows   (decode_step.py)

While every running generation decodes plain steps, steps are pipelined: a step is built on the
tokens the last one drew before they are read (pipelined.py). A request arriving during a step
may stop a prefill chunk between two layers (`step`'s `arrival`).

A generation's batched decode rows are bitwise its lone rows when the model's matmul kernels are
row-invariant (checked once per model; see `native.batched`). Otherwise each row runs its own
graph inside the same step: slower, still exact.
"""

from __future__ import annotations

from mlxkv_inference.binding import DEFAULT_PREFILL_CHUNK, MlxAutoregressiveBinding
from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.generation.results import TextDelta
from mlxkv_inference.scheduler.decode_step import STEP_MAX_ROWS, decode
from mlxkv_inference.scheduler.outcome import Arrival, Outcomes, StepOutcome
from mlxkv_inference.scheduler.pipelined import decode_ahead, pipelined_rows, read_in_flight
from mlxkv_inference.scheduler.prefill_plan import PrefillPlanner

DEFAULT_MAX_BATCH = 8


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
        one's tokens are read (see `pipelined.py`; the tokens are the same either way)."""
        if max_batch < 1:
            raise ValueError(f"max batch={max_batch} must be >= 1")
        if prefill_budget < 1:
            raise ValueError(f"prefill budget={prefill_budget} must be >= 1 token a step")
        if prefill_step_s < 0:
            raise ValueError(f"prefill step time={prefill_step_s} must be >= 0 seconds (0: no time bound)")
        self.binding = binding
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self.prefill_step_s = prefill_step_s
        self.pipelined = pipelined
        self.running: list[Generation] = []
        self.batched_steps = 0  # decode steps that ran stacked rows (the others ran a graph per row)
        self.pipelined_steps = 0  # of those, built before the last step's tokens were read
        self.largest_batch = 0  # the most generations one step has run
        self._planner = PrefillPlanner(binding, prefill_budget, prefill_step_s)

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
        outcomes: Outcomes = {}
        for generation in self.running:
            if generation.cancelled and not generation.done:  # also mid-prefill: finish() ends it cancelled
                outcomes[id(generation)] = StepOutcome(generation, (), True)
        read: dict[int, tuple[TextDelta, ...]] = {}
        feeding = pipelined_rows(self.binding, self.running, outcomes, arrival) if self.pipelined else []
        if feeding:
            if decode_ahead(self.binding, self.running, feeding, outcomes):
                self.batched_steps += 1
                self.pipelined_steps += 1
        else:
            read = read_in_flight(self.running, outcomes)
            self._prefill(outcomes, arrival)
            self._decode([g for g in self.running if id(g) not in outcomes and not g.done and not g.prefilling], outcomes)
        for generation in self.running:
            if id(generation) not in outcomes and (generation.done or id(generation) in read):
                outcomes[id(generation)] = StepOutcome(generation, (), False)
        return [self._settle(outcomes[id(g)], read.get(id(g), ())) for g in list(self.running) if id(g) in outcomes]

    def _prefill(self, outcomes: Outcomes, arrival: Arrival | None) -> None:
        self._planner.prefill(self.running, outcomes, arrival)

    def _decode(self, ready: list[Generation], outcomes: Outcomes) -> None:
        decoded = decode(self.binding, ready, outcomes)
        self.batched_steps += int(decoded.batched)
        if decoded.fresh_seconds is not None:
            self._planner.fresh_seconds = decoded.fresh_seconds

    def _settle(self, outcome: StepOutcome, read: tuple[TextDelta, ...]) -> StepOutcome:
        """The step's outcome for one generation, with the text read from its tokens in flight
        first; one that ended is finished (its held-back text as `tail`) and leaves the batch."""
        generation = outcome.generation
        if read:
            outcome = StepOutcome(generation, read + outcome.deltas, outcome.finished, outcome.error)
        if outcome.error is None and (generation.done or outcome.finished):
            outcome = StepOutcome(generation, outcome.deltas, True, tail=tuple(generation.finish()))
        if outcome.finished or outcome.error is not None:
            self.running.remove(generation)
            self._planner.forget(generation)
        return outcome
