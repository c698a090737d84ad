"""Text-level generation: the loop plus detokenization, stop conditions and timing."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx

from mlxkv_inference.binding import DEFAULT_PREFILL_CHUNK, Interrupt, MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.generation.constraint import Grammar, GrammarConstraint
from mlxkv_inference.generation.detokenizer import IncrementalDetokenizer
from mlxkv_inference.generation.logits import context_window, make_logits_processors
from mlxkv_inference.cache.reuse import all_trimmable, covered_tokens, frozen_copy
from mlxkv_inference.generation.loop import Ahead, Decoder, Drawn, PrefillProgress, SequenceRun, TokenStep
from mlxkv_inference.speculative.proposers import DraftModel, DraftState, PromptLookup, Proposer
from mlxkv_inference.generation.sampling import SamplingParams, choose_seed, make_sampler
from mlxkv_inference.speculative.speculation import SpeculativeParams, round_fits
from mlxkv_inference.speculative.speculator import Speculator

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True, slots=True)
class GenerationParams:
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    ignore_eos: bool = False  # generate max_tokens even past EOS (benchmarks)
    compiled_decode: bool = True
    grammar: Grammar | None = None  # what the generated text must match (JSON schema, Lark, regex)
    speculative: SpeculativeParams = field(default_factory=SpeculativeParams)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} must be >= 1")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.ignore_eos and self.grammar is not None:
            raise ValueError("ignore_eos cannot be combined with a grammar: a grammar ends its answer with EOS")


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Newly final text and the token that produced it ('' while text is held back); `step` is
    None for text replayed from a checkpoint."""

    text: str
    step: TokenStep | None


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a checkpointed generation stands: tokens already generated (and fed to the caches)
    and the token sampled next, never fed; `draft`: its draft model's state, where checkpointed."""

    generated: tuple[int, ...]
    pending: int
    draft: DraftState | None = None


@dataclass(frozen=True, slots=True)
class CheckpointState:
    """A consistent snapshot: `caches` hold the prompt and `generated`; `pending` comes next,
    sampled from `pending_logprobs` (over the vocabulary). `draft`: the draft model's caches
    (speculating in mode "draft"), holding a prefix of the prompt and `generated`."""

    generated: tuple[int, ...]
    pending: int
    caches: list[LayerCache]
    seed: int
    pending_logprobs: mx.array
    draft: DraftState | None = None


@dataclass(frozen=True, slots=True)
class GenerationResult:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    seed: int
    ttft_s: float
    prefill_tps: float
    decode_tps: float
    draft_tokens: int = 0  # drafts speculative rounds verified
    accepted_tokens: int = 0  # of those, accepted


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
        on_snapshot: Callable[[Sequence[int], list[LayerCache]], None] | None = None,
        resume: ResumePoint | None = None,
        checkpoint_every: int = 0,
        on_checkpoint: Callable[[CheckpointState], None] | None = None,
        on_prefill_progress: PrefillProgress | None = None,
        draft: MlxAutoregressiveBinding | None = None,
    ) -> None:
        self._binding = binding
        self._params = params
        self.seed = params.sampling.seed if params.sampling.seed is not None else choose_seed()
        self.caches = caches if caches is not None else binding.make_cache()
        self.cached_tokens = covered_tokens(self.caches)
        self._resume = resume
        replayed = list(resume.generated) if resume is not None else []
        self.prompt = list(prompt) + replayed
        self._original_prompt = len(prompt)
        self._max_new = params.max_tokens - len(replayed)
        self._run = SequenceRun(
            binding, self.prompt, self.caches, sampler=make_sampler(params.sampling, self.seed, binding.native_sampler),
            processors=make_logits_processors(params.sampling), context_window=context_window(params.sampling),
            first_step=len(replayed), pending=resume.pending if resume is not None else None,
            constraint=GrammarConstraint(params.grammar, binding.tokenizer, replay=replayed) if params.grammar is not None else None,
        )
        self._decoder = Decoder(binding, self.caches, params.compiled_decode)
        proposer = _make_proposer(params.speculative, draft, resume.draft if resume is not None else None,
                                  self.caches if draft is not None and draft.prefix_of is binding else None)
        self._speculator = Speculator(params.speculative, proposer, binding.step_costs) if proposer is not None else None
        self._draft_model = proposer if isinstance(proposer, DraftModel) else None
        self._drafts: list[int] = []  # the open round's drafts (empty: a plain step)
        self._round_rows = 0  # positions the open step feeds
        self._joining = False  # the rest of the prompt rides in the next decode step (see `join`)
        self._joined = False  # the open step feeds the rest of the prompt: its last position samples
        self._drawn: Drawn | None = None  # a plain step's sampling graph, drawn before `accept`
        self._ahead: deque[Ahead] = deque()  # tokens a pipelined step drew and fed on, unread (oldest first)
        self._alone_since = 0.0  # when a step this generation drives alone started (0: batched)
        self._due: tuple[tuple[int, ...], TokenStep] | None = None  # a checkpoint to take after the step
        self._points = sorted({p for p in snapshot_at if self.cached_tokens < p <= len(self.prompt) - 1})
        self._on_snapshot = on_snapshot
        self._snapshot_due: int | None = None  # a snapshot point reached by a chunk an interrupt stopped
        self._on_prefill_progress = on_prefill_progress if resume is None else None
        self._prefill_total = self._run.prefill_left
        self._checkpoint_every = checkpoint_every
        self._on_checkpoint = on_checkpoint
        self._tokens: list[int] = []
        self._yielded: list[int] = []  # every token the loop produced, EOS included
        self._emitted = 0  # tokens produced in this run (a resumed pending token included)
        self._last_step: TokenStep | None = None
        self._detok = IncrementalDetokenizer(binding.tokenizer, params.stop)
        self._finish: FinishReason = "length"
        self._cancelled = False
        self.done = False
        self._t0 = 0.0
        self._t_first = 0.0
        self._t_end = 0.0
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[TextDelta]:
        yield from self.start()
        while self.prefilling:
            self.prefill(self._prefill_total)
        while not self.done:
            if self._cancelled:
                self._stop("cancelled")
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
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    # -- the phases a scheduler drives -------------------------------------------------------
    def start(self) -> list[TextDelta]:
        """Start the clock; a resumed generation's text so far, sent again first."""
        self._t0 = time.perf_counter()
        if self._on_prefill_progress is not None and self._prefill_total > 0:
            self._on_prefill_progress(0, self._prefill_total)
        if self._max_new < 1:
            self.done = True
        replay: list[TextDelta] = []
        for token in self._resume.generated if self._resume is not None else ():
            self._tokens.append(token)
            self._yielded.append(token)
            replay.append(TextDelta(self._detok.add(token), None))
        return replay

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are left to feed, or to evaluate (see `prefill`)."""
        return not self.done and not self._joining and (self._run.prefill_left > 0 or self._run.unevaluated > 0)

    def prefill(self, budget: int, interrupt: Interrupt | None = None) -> int:
        """Feed up to `budget` prompt tokens (stopping at the next snapshot point, which is then
        taken); returns how many were fed. Where `interrupt` stops the evaluation of a chunk, the
        chunk counts as fed and is the last (see `MlxAutoregressiveBinding.prefill`); what it left
        is evaluated first by the next call or by `finish_chunk`."""
        run = self._run
        point = next((p for p in self._points if p > run.cached), run.prefill_end)
        upto = min(point, run.cached + max(budget, 0))
        before = run.cached
        report = self._on_prefill_progress
        done_before = before - (run.prefill_end - self._prefill_total)
        if not self.finish_chunk(interrupt):
            return 0
        run.prefill(upto, self._params.prefill_chunk,
                    None if report is None else (lambda fed: report(done_before + fed, self._prefill_total)), interrupt)
        if run.cached in self._points and run.cached > before:
            self._snapshot_due = run.cached
            if not run.unevaluated:  # else once `finish_chunk` has evaluated the chunk an interrupt stopped
                self.finish_chunk()
        return run.cached - before

    def can_join(self, most: int) -> bool:
        """Whether the rest of the prompt and its last token (at most `most` positions) may be
        fed in one forward with the first decode step (`join`): a prefill not stopped mid-chunk,
        a model whose forward over several positions is bitwise single steps (so the chunks a
        prompt is fed in change nothing), caches that neither wrap a sliding window nor cross
        the KV scheme's quantization start over those positions (`round_fits`), and snapshot
        points left only where trimmable caches serve them from the state after the step."""
        run = self._run
        positions = run.prefill_left + 1
        if not self.prefilling or run.unevaluated or self._resume is not None or positions > most:
            return False
        if not self._binding.verifies_positions() or round_fits(self.caches, positions, self._binding.kv_scheme) < positions:
            return False
        return self._on_snapshot is None or not any(p > run.cached for p in self._points) or all_trimmable(self.caches)

    def join(self) -> None:
        """Feed the rest of the prompt with the first decode step (`can_join` said it may): the
        generation is ready to step, `step_input` gives the prompt's rest and its last token, and
        the first token is sampled from the last position (`logit_rows`). A step feeding several
        sequences saves a forward a prompt (the decode rows no longer wait for a prefill forward
        of their own), and a batched step runs the head on the prompt's last position alone."""
        if not self.can_join(self._run.prefill_left + 1):
            raise ValueError("this generation's prompt cannot be fed with its first decode step")
        self._joining = True
        self._points = [p for p in self._points if p > self._run.cached]  # the ones it passes

    @property
    def joining_rows(self) -> int:
        """The rows the next step feeds for the prompt's rest and its last token (0: no `join`)."""
        return self._run.prefill_left + 1 if self._joining else 0

    @property
    def logit_rows(self) -> int:
        """The open step's last rows whose logits `draw` and `accept` read: the last one where
        the step feeds the prompt's rest (`join`), else every row it feeds."""
        return 1 if self._joined else self._round_rows

    @property
    def unevaluated(self) -> int:
        """Tokens of the last prefill chunk an interrupt left partly unevaluated (see `prefill`)."""
        return self._run.unevaluated if not self.done else 0

    def finish_chunk(self, interrupt: Interrupt | None = None) -> bool:
        """Evaluate what an interrupt left of the last prefill chunk (at least one more layer,
        unless `interrupt` lets it finish) and take the snapshot due where it ended; whether
        nothing is left."""
        if not self._run.finish_chunk(interrupt):
            return False
        if self._snapshot_due is not None and self._on_snapshot is not None:
            self._on_snapshot(self.prompt[: self._snapshot_due], self.caches)
        self._snapshot_due = None
        return True

    @property
    def needs_step(self) -> bool:
        """Whether the next token comes from a decode step (not a resumed pending token)."""
        return not self.done and not self.prefilling and not (self._resume is not None and self._emitted == 0)

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to prefill (none once they ride in the next step: `join`)."""
        return self._run.prefill_left if not self.done and not self._joining else 0

    @property
    def prefill_chunk(self) -> int:
        return self._params.prefill_chunk

    def step_input(self, batch: int = 1, sequences: int = 1, most_drafts: int | None = None) -> mx.array:
        """The tokens the next decode step feeds: the pending token, then the drafts of a
        speculative round (if this step speculates), at most `most_drafts`; or the prompt's rest
        and its last token (`join`). `batch`: the rows the step feeds besides this generation's
        drafts (its own pending token included); `sequences`: the generations sharing the step
        (this one included)."""
        if self._joining:
            self._joining, self._joined, self._drafts = False, True, []
            tokens = self._run.join_input()
        else:
            self._drafts = self._draft(batch, sequences, most_drafts)
            tokens = self._run.round_input(self._drafts) if self._drafts else self._run.decode_input()
        self._round_rows = int(tokens.size)
        return tokens

    def decode_alone(self, tokens: mx.array | None = None) -> mx.array:
        """(L, vocab) logits of feeding `tokens` (default: `step_input()`) through this
        generation's own graph ((1, vocab) of the last position where they carry the prompt's
        rest: `join`)."""
        if tokens is None:
            tokens = self.step_input()
        self._alone_since = time.perf_counter()
        if self._joined:  # the graph: a compiled step would trace every prompt length anew
            return self._binding.decode(tokens, self.caches)
        logits = self._decoder(tokens)
        if self._decoder.traced:  # a step cost measured with a trace in it would put its size off for good
            self._alone_since = 0.0
        return logits

    def draw(self, logits: mx.array) -> list[mx.array]:
        """Build the sampling of a plain step's token from its (1, vocab) `logits`, for `accept`
        to take: the arrays to evaluate (a batched step evaluates every row's together; one eval
        a row cost ~0.2 ms a row), none where the step is a speculative round."""
        if self._drafts or self._cancelled:
            return []
        self._drawn = self._run.draw(logits)
        return list(self._drawn)

    def accept(self, logits: mx.array | None) -> list[TextDelta]:
        """Take the next token(s): sampled from `logits`, the (`logit_rows`, vocab) logits of
        feeding `step_input()` (a speculative round's accepted drafts and the token after them),
        or, with None, a resumed generation's pending token. A checkpoint due at one of them is
        taken once the caches hold exactly the tokens before it."""
        drawn, self._drawn = self._drawn, None
        if self._joined:  # the step fed the prompt's rest: the logits are its last position's
            self._joined = False
            if not self._cancelled:
                self._prefilled()
        if self._cancelled:
            if self._drafts:
                self._run.end_round(1)
            self._stop("cancelled")
            return []
        if logits is None:
            pending = self._run.take_pending()
            assert pending is not None
            steps = [pending]
        elif self._drafts:
            steps = self._run.sample_round(logits)
        else:
            steps = [self._run.take(drawn) if drawn is not None else self._run.sample(logits)]
        deltas: list[TextDelta] = []
        taken = 0
        for step in steps:
            taken += 1
            deltas.extend(self._take(step))
            if self.done:
                break
        if self._drafts:
            self._run.end_round(taken)
        if self._due is not None:
            self._checkpoint(*self._due)
            self._due = None
        if self._alone_since:
            self._binding.step_costs.record(self._round_rows, time.perf_counter() - self._alone_since)
            self._alone_since = 0.0
        if self._speculator is not None and logits is not None:
            self._speculator.observe(self._drafts, [s.token for s in steps[:taken]])
        self._drafts = []
        return deltas

    # -- pipelined steps: the next token fed before it is read ------------------------------
    def runs_ahead(self, sequences: int) -> bool:
        """Whether a pipelined step may feed this generation's next token before reading the
        one in flight (see `BatchScheduler`): a plain step, with nothing that needs the token's
        value first (a grammar's mask, drafts, a checkpoint at the token in flight) and caches
        that can drop a fed token again (where the generation ends on the token in flight).
        `sequences`: the generations the step feeds."""
        if not self.needs_step or self._cancelled or self._run.constrained or self._draft_model is not None:
            return False
        if self._produced >= self._max_new or (self._ahead and self._checkpoint_due(self._emitted)):
            return False
        spec = self._speculating
        if spec is not None and spec.plans_drafts(self._draft_limit(spec, self._produced), sequences, sequences, pipelining=True):
            return False
        return round_fits(self.caches, 2, self._binding.kv_scheme) >= 2

    @property
    def ahead_ends(self) -> bool:
        """Whether reading the tokens in flight reaches max_tokens (nothing more to feed)."""
        return bool(self._ahead) and self._produced >= self._max_new

    @property
    def _produced(self) -> int:
        """Tokens produced once the tokens in flight are read."""
        return self._emitted + len(self._ahead)

    @property
    def in_flight(self) -> int:
        """Tokens a pipelined step drew and fed on, not read yet."""
        return len(self._ahead)

    def ahead_input(self, sequences: int) -> mx.array:
        """The (1,) token a pipelined step feeds (`runs_ahead(sequences)` said it may): the last
        one drawn, read or not. The speculator counts the step as a plain one, as it would a
        plain step's (prompt lookup guesses the token read next)."""
        spec = self._speculating
        if spec is not None:
            drafts = spec.drafts(self._history(), self._draft_limit(spec, self._produced), sequences, sequences,
                                 pipelining=True)
            assert not drafts, "runs_ahead found that this step drafts nothing"
        return self._run.decode_input()

    def draw_ahead(self, logits: mx.array) -> list[mx.array]:
        """Build the sampling of the token after `ahead_input()` from its (1, vocab) `logits`
        and feed on with it: the arrays to evaluate (asynchronously; `read_ahead` reads it)."""
        ahead = self._run.draw_ahead(logits)
        self._ahead.append(ahead)
        return list(ahead.drawn)

    def read_ahead(self) -> list[TextDelta]:
        """Read the oldest token in flight and take it (as `accept` takes a plain step's); where
        the generation ends on it, `finish` drops the tokens fed after it."""
        step = self._run.read(self._ahead.popleft())
        deltas = self._take(step)
        if self._due is not None:  # `runs_ahead` kept every later token unfed
            assert not self._ahead, "a checkpoint needs the caches to hold exactly the tokens before it"
            self._checkpoint(*self._due)
            self._due = None
        if self._speculator is not None:
            self._speculator.observe([], [step.token])
        return deltas

    def _land(self) -> None:
        """Drop the tokens in flight and what was fed after them: the caches and the run as
        they were before the first was drawn (a generation ending, or cancelled, with some)."""
        if not self._ahead:
            return
        for cache in self.caches:
            cache.trim(len(self._ahead))
        self._run.retreat(self._ahead[0])
        self._ahead.clear()

    def _prefilled(self) -> None:
        """What a prefill does at its points, once a step that fed the prompt's rest (`join`) is
        evaluated: the snapshots (from caches holding the whole prompt: trimmable, see
        `can_join`) and the progress report."""
        snapshot = self._on_snapshot
        if snapshot is not None:
            for point in self._points:
                snapshot(self.prompt[:point], self.caches)
        self._points = []
        if self._on_prefill_progress is not None and self._prefill_total > 0:
            self._on_prefill_progress(self._prefill_total, self._prefill_total)

    def _checkpoint_due(self, n: int) -> bool:
        """Whether taking the `n`th produced token (0-based) takes a checkpoint (see `_take`)."""
        return n > 0 and bool(self._checkpoint_every) and self._on_checkpoint is not None and n % self._checkpoint_every == 0

    def _draft(self, batch: int, sequences: int, most: int | None = None) -> list[int]:
        """Drafts for the next step, as many as may be verified in one forward exactly: within
        max_tokens, not past a checkpoint (one may fall only on a round's last token, when the
        caches hold exactly the tokens before it), and where `round_fits` allows."""
        spec = self._speculating
        if spec is None:
            return []
        limit = self._draft_limit(spec, self._emitted)
        return spec.drafts(self._history(), limit if most is None else min(limit, most), batch, sequences)

    @property
    def _speculating(self) -> Speculator | None:
        """The speculator, where this model's forward can verify drafts exactly."""
        return self._speculator if self._speculator is not None and self._binding.verifies_positions() else None

    def _draft_limit(self, spec: Speculator, n: int) -> int:
        """The most drafts a round after `n` produced tokens may verify (see `_draft`)."""
        limit = min(spec.params.num_draft_tokens, self._max_new - n - 1)
        every = self._checkpoint_every if self._on_checkpoint is not None else 0
        if every:
            due = n if n > 0 and n % every == 0 else (n // every + 1) * every
            limit = min(limit, due - n)
        return min(limit, round_fits(self.caches, limit + 1, self._binding.kv_scheme) - 1)

    def _history(self) -> list[int]:
        """The prompt and the tokens read so far (what a proposer drafts after)."""
        return self.prompt[: self._original_prompt] + self._yielded

    def _take(self, step: TokenStep) -> list[TextDelta]:
        self._last_step = step
        n = self._emitted
        if self._checkpoint_due(n):
            self._due = (tuple(self._yielded), step)
        self._emitted += 1
        if n == 0:
            self._t_first = time.perf_counter()
        if n % 256 == 255:
            mx.clear_cache()
        if self._emitted >= self._max_new:
            self.done = True
        self._yielded.append(step.token)
        if step.token in self._binding.eos_token_ids and not self._params.ignore_eos:
            self._stop("stop")
            return []
        self._tokens.append(step.token)
        text = self._detok.add(step.token)
        if self._detok.stopped:
            self._stop("stop")
        return [TextDelta(text, step)]

    def finish(self) -> list[TextDelta]:
        """End the generation (cancelled, if it was not done): set `result`; the held-back text."""
        if not self.done:
            self._stop("cancelled")
        self._land()
        tail = self._detok.finish()
        self._t_end = time.perf_counter()
        self.result = self._make_result()
        last = self._last_step
        return [TextDelta(tail, last)] if tail else []

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the generation, if one did."""
        return self._detok.stop_string

    def fed_tokens(self) -> list[int]:
        """The tokens the caches hold now: the prompt and the generated tokens fed so far."""
        return (self.prompt + self._yielded)[: covered_tokens(self.caches)]

    def _stop(self, reason: FinishReason) -> None:
        self._finish = reason
        self.done = True

    def _checkpoint(self, generated: tuple[int, ...], pending: TokenStep) -> None:
        assert self._on_checkpoint is not None
        # The caches hold exactly the prompt and `generated` here: `pending` is not fed yet.
        copies = frozen_copy(self.caches, covered_tokens(self.caches))
        history = self.prompt[: self._original_prompt] + list(generated)
        draft = self._draft_model.snapshot(history) if self._draft_model is not None else None
        self._on_checkpoint(CheckpointState(generated, pending.token, copies, self.seed, pending.logprobs, draft))

    def _make_result(self) -> GenerationResult:
        prefilled = len(self.prompt) - self.cached_tokens
        ttft = self._t_first - self._t0
        decode_time = self._t_end - self._t_first
        n = len(self._tokens) - (len(self._resume.generated) if self._resume is not None else 0)  # decoded in this run
        return GenerationResult(
            token_ids=tuple(self._tokens),
            text=self._detok.text,
            finish_reason=self._finish,
            prompt_tokens=self._original_prompt,
            cached_tokens=self.cached_tokens,
            generated_tokens=len(self._tokens),
            seed=self.seed,
            ttft_s=ttft,
            prefill_tps=prefilled / ttft if ttft > 0 else 0.0,
            decode_tps=(n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0,
            draft_tokens=self._speculator.drafted if self._speculator is not None else 0,
            accepted_tokens=self._speculator.accepted if self._speculator is not None else 0,
        )


def _make_proposer(params: SpeculativeParams, draft: MlxAutoregressiveBinding | None,
                   draft_state: DraftState | None, target: list[LayerCache] | None) -> Proposer | None:
    if params.mode == "off":
        return None
    if params.mode == "prompt_lookup":
        return PromptLookup(params.ngram_min, params.ngram_max)
    if draft is None:
        raise ValueError("speculative mode 'draft' needs a draft model (serve/generate --draft-model or --draft-layers)")
    return DraftModel(draft, draft_state, target)
