"""One generation, alone or driven by a scheduler: the phases acting on a sequence's state.

    SequenceState   tokens, caches, seed, stop/finish          (sequence.py)
    PromptPrefill   chunks, snapshot points, `join`             (prefill.py)
    Drafting        a speculative round's drafts                (drafting.py)
    RunAhead        pipelined steps' tokens in flight           (run_ahead.py)
    CheckpointSchedule, StepTimer                               (checkpoints.py, timing.py)

built and wired once from the parameters (assembly.py); what it calls back: hooks.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Unpack

import mlx.core as mx

from mlxkv_inference.binding import Interrupt, MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.generation.assembly import assemble
from mlxkv_inference.generation.hooks import GenerationHooks, HookFields, hooks_from
from mlxkv_inference.generation.loop import Drawn, TokenStep
from mlxkv_inference.generation.results import GenerationParams, GenerationResult, ResumePoint, TextDelta


class Generation:
    """One generation: iterate for `TextDelta`s, then read `result`; or let a scheduler drive it
    (`start`, `prefill` under a token budget or `join` its first decode step with the prompt's
    rest, one `step_input` and `accept` per decode step, `finish`), alone or with others.

    Generated token ids exclude the EOS token and any token after a stop string. The one way to
    continue a generation is `resume`: its caches already hold the prompt and the generated tokens.
    `hooks` (`GenerationHooks`, or its fields as keywords: `snapshot_at=`, `on_checkpoint=`, ...)
    are what it calls back: `on_snapshot(tokens, caches)` at each of the prompt's `snapshot_at`
    points with caches holding `tokens`, or, where the prompt's rest rode in a decode step (`join`), holding
    the whole prompt: trimmable caches, whose first `len(tokens)` positions are the snapshot.
    """

    def __init__(
        self,
        binding: MlxAutoregressiveBinding,
        prompt: Sequence[int],
        params: GenerationParams,
        caches: list[LayerCache] | None = None,
        *,
        resume: ResumePoint | None = None,
        draft: MlxAutoregressiveBinding | None = None,
        hooks: GenerationHooks | None = None,
        **hook_fields: Unpack[HookFields],
    ) -> None:
        parts = assemble(binding, prompt, params, caches, hooks_from(hooks, hook_fields), resume, draft)
        self._binding = binding
        self._seq = seq = parts.sequence
        self.seed, self.caches, self.cached_tokens = seq.seed, seq.caches, seq.cached_tokens  # cached: a prompt cache hit
        self.prompt = seq.prompt  # the prompt and, resumed, the tokens generated before the restart
        self._run = parts.run
        self._decoder = parts.decoder
        self._prefill = parts.prefill
        self._checkpoints = parts.checkpoints
        self._drafting = parts.drafting
        self._timer = parts.timer
        self._take = parts.take
        self.ahead = parts.ahead  # a pipelined step's tokens in flight: a scheduler feeds and reads them
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

    # -- pipelined steps: the next token fed before it is read (through `ahead`) ----------------
    @property
    def ahead_ends(self) -> bool:
        """Whether reading the tokens in flight reaches max_tokens (nothing more to feed)."""
        return self.ahead.ends

    @property
    def in_flight(self) -> int:
        """Tokens a pipelined step drew and fed on, not read yet."""
        return len(self.ahead)

    def finish(self) -> list[TextDelta]:
        """End the generation (cancelled, if it was not done): set `result`; the held-back text."""
        if not self.done:
            self._seq.stop("cancelled")
        self.ahead.land()
        tail = self._seq.detokenizer.finish()
        self._timer.end()
        self.result = self._seq.result(self._timer.rates(len(self.prompt) - self.cached_tokens, self._seq.decoded),
                                       self._drafting.drafted, self._drafting.accepted)
        return [TextDelta(tail, self._seq.last_step)] if tail else []

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the generation, if one did."""
        return self._seq.detokenizer.stop_string

    @property
    def produced(self) -> int:
        """Tokens produced so far (read: a pipelined step's tokens in flight are not yet)."""
        return self._seq.emitted

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

