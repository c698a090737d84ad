"""When a generation takes its checkpoints, and the consistent snapshot each one is."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlxkv_inference.cache.reuse import covered_tokens, frozen_copy
from mlxkv_inference.generation.loop import TokenStep
from mlxkv_inference.generation.results import CheckpointState
from mlxkv_inference.generation.sequence import SequenceState
from mlxkv_inference.speculative.proposers import DraftModel


class CheckpointSchedule:
    """A checkpoint every `every` produced tokens (none without `on_checkpoint`), taken at the
    token due once the caches hold exactly the tokens before it: that token is not fed yet, and
    a resumed generation starts from it (`ResumePoint.pending`)."""

    def __init__(self, every: int, on_checkpoint: Callable[[CheckpointState], None] | None) -> None:
        self._every = every if on_checkpoint is not None else 0
        self._on_checkpoint = on_checkpoint
        self._due: tuple[tuple[int, ...], TokenStep] | None = None  # to take once the step is done

    def is_due(self, n: int) -> bool:
        """Whether taking the `n`th produced token (0-based) takes a checkpoint."""
        return n > 0 and bool(self._every) and n % self._every == 0

    def next_at(self, n: int) -> int | None:
        """The produced-token count of the next checkpoint from `n` on (None: no checkpoints)."""
        if not self._every:
            return None
        return n if n > 0 and n % self._every == 0 else (n // self._every + 1) * self._every

    def note(self, n: int, generated: Sequence[int], step: TokenStep) -> None:
        """Taking the `n`th produced token `step` after `generated`: mark the checkpoint due."""
        if self.is_due(n):
            self._due = (tuple(generated), step)

    @property
    def pending(self) -> bool:
        return self._due is not None

    def take(self, sequence: SequenceState, draft_model: DraftModel | None) -> None:
        """Take the checkpoint marked due, if one is: the caches hold exactly the prompt and its
        `generated` tokens here."""
        if self._due is None:
            return
        assert self._on_checkpoint is not None
        (generated, pending), self._due = self._due, None
        copies = frozen_copy(sequence.caches, covered_tokens(sequence.caches))
        history = sequence.prompt[: sequence.original_prompt] + list(generated)
        draft = draft_model.snapshot(history) if draft_model is not None else None
        self._on_checkpoint(CheckpointState(generated, pending.token, copies, sequence.seed, pending.logprobs, draft))
