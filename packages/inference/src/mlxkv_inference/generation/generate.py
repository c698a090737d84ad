"""One generation, alone or driven by a scheduler: the phases acting on a sequence's state.

    SequenceState   tokens, caches, seed, stop/finish          (sequence.py)
    PromptPrefill   chunks, snapshot points, `join`             (prefill.py)
    Drafting        a speculative round's drafts                (drafting.py)
    RunAhead        pipelined steps' tokens in flight           (run_ahead.py)
    CheckpointSchedule, StepTimer                               (checkpoints.py, timing.py)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx

from mlxkv_inference.binding import Interrupt, MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.generation.checkpoints import CheckpointSchedule
from mlxkv_inference.generation.constraint import GrammarConstraint
from mlxkv_inference.generation.detokenizer import IncrementalDetokenizer
from mlxkv_inference.generation.drafting import Drafting
from mlxkv_inference.generation.logits import context_window, make_logits_processors
from mlxkv_inference.generation.loop import Decoder, Drawn, PrefillProgress, SequenceRun, TokenStep
from mlxkv_inference.generation.prefill import OnSnapshot, PromptPrefill
from mlxkv_inference.generation.run_ahead import RunAhead
from mlxkv_inference.generation.results import (CheckpointState, FinishReason, GenerationParams, GenerationResult,
                                                ResumePoint, TextDelta)
from mlxkv_inference.generation.sampling import choose_seed, make_sampler
from mlxkv_inference.generation.sequence import SequenceState
from mlxkv_inference.generation.timing import StepTimer

__all__ = ["CheckpointState", "FinishReason", "Generation", "GenerationParams", "GenerationResult", "ResumePoint",
           "TextDelta"]


class Generation:
    """One generation: iterate for `TextDelta`s, then read `result`; or let a scheduler drive it
    (`start`, `prefill` under a token budget or `join` its first decode step with the prompt's
    rest, one `step_input` and `accept` per decode step, `finish`), alone or with others.

    Generated token ids exclude the EOS token and any token after a stop string. The one way to
    continue a generation is `resume`: its caches already hold the prompt and the generated tokens.
    `on_snapshot(tokens, caches)` is called at each of the prompt's `snapshot_at` points with
    caches holding `tokens`, or, where the prompt's rest rode in a decode step (`join`), holding
    the whole prompt: trimmable caches, whose first `len(tokens)` positions are the snapshot.
    """

    def __init__(
        self,
        binding: MlxAutoregressiveBinding,
        prompt: Sequence[int],
        params: GenerationParams,
        caches: list[LayerCache] | None = None,
        *,
        snapshot_at: Sequence[int] = (),
        on_snapshot: OnSnapshot | None = None,
        resume: ResumePoint | None = None,
        checkpoint_every: int = 0,
        on_checkpoint: Callable[[CheckpointState], None] | None = None,
        on_prefill_progress: PrefillProgress | None = None,
        draft: MlxAutoregressiveBinding | None = None,
    ) -> None:
        self._binding = binding
        self._params = params
        seed = params.sampling.seed if params.sampling.seed is not None else choose_seed()
        self._seq = seq = SequenceState(prompt, caches if caches is not None else binding.make_cache(), seed,
                                        params.max_tokens, IncrementalDetokenizer(binding.tokenizer, params.stop), resume)
        self.seed, self.caches, self.cached_tokens = seed, seq.caches, seq.cached_tokens  # cached: a prompt cache hit
        self.prompt = seq.prompt  # the prompt and, resumed, the tokens generated before the restart
        self._run = _make_run(binding, seq, params)
        self._decoder = Decoder(binding, seq.caches, params.compiled_decode)
        self._prefill = PromptPrefill(binding, self._run, seq, params.prefill_chunk, snapshot_at, on_snapshot, on_prefill_progress)
        self._checkpoints = CheckpointSchedule(checkpoint_every, on_checkpoint)
        self._drafting = Drafting(binding, seq, self._checkpoints, params.speculative, draft)
        self._timer = StepTimer()
        self._take = _taker(binding, params, seq, self._checkpoints, self._timer)
        self._ahead = RunAhead(binding, self._run, seq, self._checkpoints, self._drafting, self._take)
        self._round_rows = 0  # positions the open step feeds
        self._drawn: Drawn | None = None  # a plain step's sampling graph, drawn before `accept`
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[TextDelta]:
        yield from self.start()
        while self.prefilling:
            self.prefill(self._prefill.total)
        while not self.done:
            if self._seq.cancelled:
                self._seq.stop("cancelled")
                break
            yield from self.accept(self.decode_alone() if self.needs_step else None)
        yield from self.finish()

    def run(self) -> GenerationResult:
        """Consume the whole generation and return its result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def cancel(self) -> None:
        """Stop before the next token (from the thread driving this generation)."""
        self._seq.cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._seq.cancelled

    @property
    def done(self) -> bool:
        return self._seq.done

    # -- the phases a scheduler drives -------------------------------------------------------
    def start(self) -> list[TextDelta]:
        """Start the clock; a resumed generation's text so far, sent again first."""
        self._timer.start()
        self._prefill.start()
        if self._seq.max_new < 1:
            self._seq.done = True
        return self._seq.replay()

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are left to feed, or to evaluate (see `prefill`)."""
        return self._prefill.active

    def prefill(self, budget: int, interrupt: Interrupt | None = None) -> int:
        """Feed up to `budget` prompt tokens; how many were fed (see `PromptPrefill.feed`)."""
        return self._prefill.feed(budget, interrupt)

    def can_join(self, most: int) -> bool:
        """Whether the prompt's rest may ride in the first decode step (see `PromptPrefill.can_join`)."""
        return self._prefill.can_join(most)

    def join(self) -> None:
        """Feed the prompt's rest with the first decode step (see `PromptPrefill.join`)."""
        self._prefill.join()

    @property
    def joining_rows(self) -> int:
        """The rows the next step feeds for the prompt's rest and its last token (0: no `join`)."""
        return self._prefill.joining_rows

    @property
    def logit_rows(self) -> int:
        """The open step's last rows whose logits `draw` and `accept` read: the last one where
        the step feeds the prompt's rest (`join`), else every row it feeds."""
        return 1 if self._prefill.joined else self._round_rows

    @property
    def unevaluated(self) -> int:
        """Tokens of the last prefill chunk an interrupt left partly unevaluated (see `prefill`)."""
        return self._prefill.unevaluated

    def finish_chunk(self, interrupt: Interrupt | None = None) -> bool:
        """Evaluate what an interrupt left of the last chunk (see `PromptPrefill.finish_chunk`)."""
        return self._prefill.finish_chunk(interrupt)

    @property
    def needs_step(self) -> bool:
        """Whether the next token comes from a decode step (not a resumed pending token)."""
        return not self.done and not self.prefilling and not self._seq.awaits_pending

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to prefill (none once they ride in the next step: `join`)."""
        return self._prefill.left

    @property
    def prefill_chunk(self) -> int:
        return self._prefill.chunk

    def step_input(self, batch: int = 1, sequences: int = 1, most_drafts: int | None = None) -> mx.array:
        """The tokens the next decode step feeds: the pending token, then the drafts of a
        speculative round (if this step speculates), at most `most_drafts`; or the prompt's rest
        and its last token (`join`). `batch`: the rows the step feeds besides this generation's
        drafts (its own pending token included); `sequences`: the generations sharing the step
        (this one included)."""
        if self._prefill.joining:
            self._drafting.close(None)
            tokens = self._prefill.join_input()
        else:
            drafts = self._drafting.draft(batch, sequences, most_drafts)
            tokens = self._run.round_input(drafts) if drafts else self._run.decode_input()
        self._round_rows = int(tokens.size)
        return tokens

    def decode_alone(self, tokens: mx.array | None = None) -> mx.array:
        """(L, vocab) logits of feeding `tokens` (default: `step_input()`) through this
        generation's own graph ((1, vocab) of the last position where they carry the prompt's
        rest: `join`)."""
        if tokens is None:
            tokens = self.step_input()
        self._timer.step_alone()
        if self._prefill.joined:  # the graph: a compiled step would trace every prompt length anew
            return self._binding.decode(tokens, self.caches)
        logits = self._decoder(tokens)
        if self._decoder.traced:
            self._timer.untimed()
        return logits

    def draw(self, logits: mx.array) -> list[mx.array]:
        """Build the sampling of a plain step's token from its (1, vocab) `logits`, for `accept`
        to take: the arrays to evaluate (a batched step evaluates every row's together), none
        where the step is a speculative round."""
        if self._drafting.drafts or self._seq.cancelled:
            return []
        self._drawn = self._run.draw(logits)
        return list(self._drawn)

    def accept(self, logits: mx.array | None) -> list[TextDelta]:
        """Take the next token(s): sampled from `logits`, the (`logit_rows`, vocab) logits of
        feeding `step_input()` (a speculative round's accepted drafts and the token after them),
        or, with None, a resumed generation's pending token. A checkpoint due at one of them is
        taken once the caches hold exactly the tokens before it."""
        drawn, self._drawn = self._drawn, None
        seq, drafts = self._seq, self._drafting.drafts
        if self._prefill.joined:  # the step fed the prompt's rest: the logits are its last position's
            self._prefill.joined_step_done(seq.cancelled)
        if seq.cancelled:
            if drafts:
                self._run.end_round(1)
            seq.stop("cancelled")
            return []
        steps = self._sample(logits, drawn, bool(drafts))
        deltas: list[TextDelta] = []
        taken = 0
        for step in steps:
            taken += 1
            deltas.extend(self._take(step))
            if seq.done:
                break
        if drafts:
            self._run.end_round(taken)
        self._checkpoints.take(seq, self._drafting.draft_model)
        self._timer.record(self._binding.step_costs, self._round_rows)
        self._drafting.close([s.token for s in steps[:taken]] if logits is not None else None)
        return deltas

    # -- pipelined steps: the next token fed before it is read ------------------------------
    def runs_ahead(self, sequences: int) -> bool:
        """Whether a pipelined step may feed the next token before the one in flight is read (`RunAhead.may_run`)."""
        return self.needs_step and self._ahead.may_run(sequences)

    @property
    def ahead_ends(self) -> bool:
        """Whether reading the tokens in flight reaches max_tokens (nothing more to feed)."""
        return self.in_flight > 0 and self._ahead.produced >= self._seq.max_new

    @property
    def in_flight(self) -> int:
        """Tokens a pipelined step drew and fed on, not read yet."""
        return len(self._ahead)

    def ahead_input(self, sequences: int) -> mx.array:
        """The (1,) token a pipelined step feeds: the last one drawn (`RunAhead.input`)."""
        return self._ahead.input(sequences)

    def draw_ahead(self, logits: mx.array) -> list[mx.array]:
        """Build the sampling of the token after `ahead_input()` from its (1, vocab) `logits`
        and feed on with it: the arrays to evaluate (asynchronously; `read_ahead` reads it)."""
        return self._ahead.draw(logits)

    def read_ahead(self) -> list[TextDelta]:
        """Read the oldest token in flight and take it (as `accept` takes a plain step's); where
        the generation ends on it, `finish` drops the tokens fed after it."""
        return self._ahead.read()

    def finish(self) -> list[TextDelta]:
        """End the generation (cancelled, if it was not done): set `result`; the held-back text."""
        if not self.done:
            self._seq.stop("cancelled")
        self._ahead.land()
        tail = self._seq.detokenizer.finish()
        self._timer.end()
        self.result = self._seq.result(self._timer.rates(len(self.prompt) - self.cached_tokens, self._seq.decoded),
                                       self._drafting.drafted, self._drafting.accepted)
        return [TextDelta(tail, self._seq.last_step)] if tail else []

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the generation, if one did."""
        return self._seq.detokenizer.stop_string

    def fed_tokens(self) -> list[int]:
        """The tokens the caches hold now: the prompt and the generated tokens fed so far."""
        return self._seq.fed_tokens()

    def _sample(self, logits: mx.array | None, drawn: Drawn | None, round_open: bool) -> list[TokenStep]:
        if logits is None:
            pending = self._run.take_pending()
            assert pending is not None
            return [pending]
        if round_open:
            return self._run.sample_round(logits)
        return [self._run.take(drawn) if drawn is not None else self._run.sample(logits)]


def _taker(binding: MlxAutoregressiveBinding, params: GenerationParams, seq: SequenceState, checkpoints: CheckpointSchedule,
           timer: StepTimer) -> Callable[[TokenStep], list[TextDelta]]:
    """Taking a produced token into `seq`. A closure over the parts, not a bound method: `RunAhead`
    holds it, and a cycle back to the `Generation` would keep its caches alive until the collector runs."""
    def take(step: TokenStep) -> list[TextDelta]:
        n = seq.emitted
        checkpoints.note(n, seq.yielded, step)
        if n == 0:
            timer.first_token()
        if n % 256 == 255:
            mx.clear_cache()
        return seq.take(step, step.token in binding.eos_token_ids and not params.ignore_eos)
    return take


def _make_run(binding: MlxAutoregressiveBinding, seq: SequenceState, params: GenerationParams) -> SequenceRun:
    """The AR loop over `seq`: its sampler, logits processors and grammar, from where a resumed
    sequence stands (its replayed tokens fed, its pending token next)."""
    sampling, replayed = params.sampling, seq.replayed
    constraint = GrammarConstraint(params.grammar, binding.tokenizer, replay=replayed) if params.grammar is not None else None
    return SequenceRun(
        binding, seq.prompt, seq.caches, sampler=make_sampler(sampling, seq.seed, binding.native_sampler),
        processors=make_logits_processors(sampling), context_window=context_window(sampling), first_step=len(replayed),
        pending=seq.resume.pending if seq.resume is not None else None, constraint=constraint,
    )
