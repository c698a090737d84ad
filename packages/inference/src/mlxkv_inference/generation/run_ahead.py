"""Pipelined steps for one sequence: its next token fed before the one in flight is read (see
`BatchScheduler`), and the tokens in flight dropped again where the sequence ends on one (trimmed,
or on a full sliding-window ring, each cell written back: `RotatingKVCache.take_back`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import mlx.core as mx

from mlxkv_inference.binding import MlxAutoregressiveBinding
from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_inference.cache.rounds import can_take_back
from mlxkv_inference.generation.checkpoints import CheckpointSchedule
from mlxkv_inference.generation.drafting import Drafting
from mlxkv_inference.generation.loop import Ahead, SequenceRun, TokenStep
from mlxkv_inference.generation.results import TextDelta
from mlxkv_inference.generation.sequence import SequenceState

Take = Callable[[TokenStep], list[TextDelta]]  # takes a produced token, as a plain step's (`Generation`)


class RunAhead:
    """The tokens a pipelined step drew and fed on, not read yet (oldest first)."""

    def __init__(self, binding: MlxAutoregressiveBinding, run: SequenceRun, sequence: SequenceState,
                 checkpoints: CheckpointSchedule, drafting: Drafting, take: Take) -> None:
        self._binding = binding
        self._run = run
        self._sequence = sequence
        self._checkpoints = checkpoints
        self._drafting = drafting
        self._take = take
        self._ahead: deque[Ahead] = deque()

    @property
    def _rings(self) -> list[RotatingKVCache]:
        return [c for c in self._sequence.caches if isinstance(c, RotatingKVCache)]

    def __len__(self) -> int:
        return len(self._ahead)

    def may_run(self, sequences: int) -> bool:
        """Whether a pipelined step may feed this generation's next token before reading the
        one in flight (see `BatchScheduler`): a plain step, with nothing that needs the token's
        value first (a grammar's mask, drafts, a checkpoint at the token in flight) and caches
        that can drop a fed token again (where the generation ends on the token in flight).
        `sequences`: the generations the step feeds.
        (The caller checked that the next token needs a plain step: `Generation.needs_step`.)"""
        seq = self._sequence
        if seq.cancelled or self._run.constrained or self._drafting.draft_model is not None:
            return False
        if self.produced >= seq.max_new or (self._ahead and self._checkpoints.is_due(seq.emitted)):
            return False
        if self._drafting.would_draft_ahead(self.produced, sequences):
            return False
        return can_take_back(seq.caches, self._binding.kv_scheme)

    @property
    def ends(self) -> bool:
        """Whether reading the tokens in flight reaches max_tokens (nothing more to feed)."""
        return bool(self._ahead) and self.produced >= self._sequence.max_new

    @property
    def produced(self) -> int:
        """Tokens produced once the tokens in flight are read."""
        return self._sequence.emitted + len(self._ahead)

    def input(self, sequences: int) -> mx.array:
        """The (1,) token a pipelined step feeds (`may_run(sequences)` said it may): the last
        one drawn, read or not. The speculator counts the step as a plain one, as it would a
        plain step's (prompt lookup guesses the token read next)."""
        self._drafting.plain_ahead(self.produced, sequences)
        for cache in self._rings:  # the step writes it into full rings where `land` can take it back
            cache.arm_undo()
        return self._run.decode_input()

    def draw(self, logits: mx.array) -> list[mx.array]:
        """Draw the next token from its (1, vocab) `logits` and feed on with it: the arrays to
        evaluate (asynchronously; `read` reads it)."""
        ahead = self._run.draw_ahead(logits)
        self._ahead.append(ahead)
        return list(ahead.drawn)

    def read(self) -> list[TextDelta]:
        """Read the oldest token in flight and take it (as a plain step's)."""
        step = self._run.read(self._ahead.popleft())
        for cache in self._rings:  # the write of the token read is for good; those of the ones in flight are not
            cache.keep_undo(len(self._ahead))
        deltas = self._take(step)
        if self._checkpoints.pending:  # `may_run` kept every later token unfed
            assert not self._ahead, "a checkpoint needs the caches to hold exactly the tokens before it"
            self._checkpoints.take(self._sequence, self._drafting.draft_model)
        self._drafting.observe_ahead(step.token)
        return deltas

    def land(self) -> None:
        """Drop the tokens in flight and what was fed after them: the caches and the run as they
        were before the first was drawn (a generation ending, or cancelled, with some)."""
        if not self._ahead:
            return
        for cache in self._sequence.caches:
            if not (isinstance(cache, RotatingKVCache) and cache.take_back(len(self._ahead))):
                cache.trim(len(self._ahead))
        self._run.retreat(self._ahead[0])
        self._ahead.clear()
