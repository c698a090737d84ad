"""A generation's prompt prefill: chunks up to its snapshot points (taking each snapshot), its
progress reports, and the prompt's rest riding in the first decode step instead (`join`)."""

from __future__ import annotations

import mlx.core as mx

from mlxkv_inference.binding import Interrupt, MlxAutoregressiveBinding
from mlxkv_inference.cache.reuse import all_trimmable
from mlxkv_inference.cache.rounds import round_fits
from mlxkv_inference.generation.hooks import GenerationHooks
from mlxkv_inference.generation.loop import SequenceRun
from mlxkv_inference.generation.sequence import SequenceState


class PromptPrefill:
    def __init__(self, binding: MlxAutoregressiveBinding, run: SequenceRun, sequence: SequenceState, chunk: int,
                 hooks: GenerationHooks) -> None:
        self._binding = binding
        self._run = run
        self._sequence = sequence
        self.chunk = chunk
        self._points = sorted({p for p in hooks.snapshot_at if sequence.cached_tokens < p <= len(sequence.prompt) - 1})
        self._on_snapshot = hooks.on_snapshot
        self._snapshot_due: int | None = None  # a snapshot point reached by a chunk an interrupt stopped
        self._on_progress = hooks.on_prefill_progress if sequence.resume is None else None
        self.total = run.prefill_left
        self.joining = False  # the rest of the prompt rides in the next decode step (see `join`)
        self.joined = False  # the open step feeds the rest of the prompt: its last position samples

    def start(self) -> None:
        if self._on_progress is not None and self.total > 0:
            self._on_progress(0, self.total)

    @property
    def active(self) -> bool:
        """Whether prompt tokens are left to feed, or to evaluate (see `feed`)."""
        run = self._run
        return not self._sequence.done and not self.joining and (run.prefill_left > 0 or run.unevaluated > 0)

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill (none once they ride in the next step: `join`)."""
        return self._run.prefill_left if not self._sequence.done and not self.joining else 0

    @property
    def unevaluated(self) -> int:
        return self._run.unevaluated if not self._sequence.done else 0

    def feed(self, budget: int, interrupt: Interrupt | None = None) -> int:
        """Feed up to `budget` prompt tokens (stopping at the next snapshot point, which is then
        taken); returns how many were fed. Where `interrupt` stops the evaluation of a chunk, the
        chunk counts as fed and is the last (see `MlxAutoregressiveBinding.prefill`); what it left
        is evaluated first by the next call or by `finish_chunk`."""
        run = self._run
        point = next((p for p in self._points if p > run.cached), run.prefill_end)
        upto = min(point, run.cached + max(budget, 0))
        before = run.cached
        report = self._on_progress
        done_before = before - (run.prefill_end - self.total)
        if not self.finish_chunk(interrupt):
            return 0
        run.prefill(upto, self.chunk, None if report is None else (lambda fed: report(done_before + fed, self.total)), interrupt)
        if run.cached in self._points and run.cached > before:
            self._snapshot_due = run.cached
            if not run.unevaluated:  # else once `finish_chunk` has evaluated the chunk an interrupt stopped
                self.finish_chunk()
        return run.cached - before

    def finish_chunk(self, interrupt: Interrupt | None = None) -> bool:
        """Evaluate what an interrupt left of the last prefill chunk (at least one more layer,
        unless `interrupt` lets it finish) and take the snapshot due where it ended; whether
        nothing is left."""
        if not self._run.finish_chunk(interrupt):
            return False
        if self._snapshot_due is not None and self._on_snapshot is not None:
            self._on_snapshot(self._sequence.prompt[: self._snapshot_due], self._sequence.caches)
        self._snapshot_due = None
        return True

    def can_join(self, most: int) -> bool:
        """Whether the rest of the prompt and its last token (at most `most` positions) may be
        fed in one forward with the first decode step (`join`): a prefill not stopped mid-chunk,
        a model whose forward over several positions is bitwise single steps (so the chunks a
        prompt is fed in change nothing), caches that neither wrap a sliding window nor cross
        the KV scheme's quantization start over those positions (`round_fits`), and snapshot
        points left only where trimmable caches serve them from the state after the step."""
        run, caches = self._run, self._sequence.caches
        positions = run.prefill_left + 1
        if not self.active or run.unevaluated or self._sequence.resume is not None or positions > most:
            return False
        if not self._binding.verifies_positions() or round_fits(caches, positions, self._binding.kv_scheme) < positions:
            return False
        return self._on_snapshot is None or not any(p > run.cached for p in self._points) or all_trimmable(caches)

    def join(self) -> None:
        """Feed the rest of the prompt with the first decode step (`can_join` said it may): the
        generation is ready to step, `step_input` gives the prompt's rest and its last token, and
        the first token is sampled from the last position (`logit_rows`). A step feeding several
        sequences saves a forward a prompt, and a batched step runs the head on its last position alone."""
        if not self.can_join(self._run.prefill_left + 1):
            raise ValueError("this generation's prompt cannot be fed with its first decode step")
        self.joining = True
        self._points = [p for p in self._points if p > self._run.cached]  # the ones it passes

    @property
    def joining_rows(self) -> int:
        return self._run.prefill_left + 1 if self.joining else 0

    def join_input(self) -> mx.array:
        """The open step's tokens: the prompt's rest and its last token."""
        self.joining, self.joined = False, True
        return self._run.join_input()

    def joined_step_done(self, cancelled: bool) -> None:
        """The step that fed the prompt's rest is evaluated: what a prefill does at its points
        (the snapshots, from caches holding the whole prompt: trimmable, see `can_join`, and the
        progress report), unless the generation was cancelled."""
        self.joined = False
        if cancelled:
            return
        if self._on_snapshot is not None:
            for point in self._points:
                self._on_snapshot(self._sequence.prompt[:point], self._sequence.caches)
        self._points = []
        if self._on_progress is not None and self.total > 0:
            self._on_progress(self.total, self.total)
