"""The autoregressive loop of one sequence, in two phases a scheduler drives.

    prompt  p0 p1 ... p(n-2) | p(n-1)          -> y0
            ^ prefill         ^ first decode step feeds it
    decode  y0 -> y1, y1 -> y2, ...             (one step feeds the last sampled token)

A resumed sequence starts with its caches holding the whole prompt (the original prompt and the
tokens generated before the restart) and the token sampled next but never fed: that one is its
first token, produced without a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxkv_inference.binding import DEFAULT_PREFILL_CHUNK, Interrupt, MlxAutoregressiveBinding, evaluate_layers
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import covered_tokens
from mlxkv_inference.cache.rounds import Round
from mlxkv_inference.generation.constraint import GrammarConstraint
from mlxkv_inference.generation.logits import LogitsProcessor
from mlxkv_inference.generation.sampling import Sampler

log = logging.getLogger(__name__)

# A step's sampled token (1,) and log-probabilities (1, vocab), as graphs (see `SequenceRun.draw`).
Drawn = tuple[mx.array, mx.array]


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One generated token, its step index and the log-probabilities it was sampled from
    (empty for a resumed pending token: the step that sampled it ran before the restart)."""

    token: int
    step: int
    logprobs: mx.array


@dataclass(frozen=True, slots=True)
class StepSampling:
    """How each step's logits become its token: the grammar's mask (`constraint`, which consumes
    each token fed after the prompt), the `processors` over the last `context_window` tokens
    seen, then the `sampler`."""

    sampler: Sampler
    processors: Sequence[LogitsProcessor] = ()
    context_window: int = 0
    constraint: GrammarConstraint | None = None


@dataclass(frozen=True, slots=True)
class Ahead:
    """A token drawn and made the next one to feed before it is read (see `SequenceRun.draw_ahead`):
    its graph, its step index, and what the run fed and had seen before it."""

    drawn: Drawn
    step: int
    previous: mx.array
    history: mx.array


class SequenceRun:
    """One sequence: `prefill` its prompt up to given points, then `sample` one token per decode
    step from the logits of feeding `decode_input()` (the caller runs the model, alone or batched).

    Step indices start at `first_step` (the sampler derives each step's key from it).
    `sampling.constraint` masks every step's logits to what its grammar allows (a resumed
    sequence's replayed tokens are its own to replay).
    """

    def __init__(self, binding: MlxAutoregressiveBinding, prompt: Sequence[int], caches: list[LayerCache],
                 sampling: StepSampling, *, first_step: int = 0, pending: int | None = None) -> None:
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        cached = covered_tokens(caches)
        if pending is None and cached >= len(prompt):
            raise ValueError(f"caches already hold {cached} tokens; the prompt has only {len(prompt)}")
        if pending is not None and cached != len(prompt):
            raise ValueError(f"resuming needs caches holding the whole prompt ({len(prompt)}), not {cached}")
        self.binding = binding
        self.prompt = list(prompt)
        self.caches = caches
        self.cached = cached  # prompt tokens the caches hold
        self.prefill_end = len(prompt) if pending is not None else len(prompt) - 1
        self.step = first_step
        self._sampler = sampling.sampler
        self._processors = tuple(sampling.processors)
        self._window = sampling.context_window if sampling.processors else 0
        seen = self.prompt if pending is not None else self.prompt[:-1]
        self._history = mx.array(seen[-self._window :] if self._window else [], dtype=mx.int32)
        self._pending = pending
        self._first_step = first_step
        self._constraint = sampling.constraint
        self._next = mx.array([self.prompt[-1]], dtype=mx.uint32) if pending is None else None
        self._round: tuple[Round, list[int]] | None = None
        self.unevaluated = 0  # tokens of the last prefill chunk an interrupt left partly unevaluated
        self._layer = 0  # the first layer of that chunk not evaluated yet

    @property
    def prefill_left(self) -> int:
        return self.prefill_end - self.cached

    def prefill(self, upto: int, chunk: int = DEFAULT_PREFILL_CHUNK, on_chunk: Callable[[int], None] | None = None,
                interrupt: Interrupt | None = None) -> None:
        """Feed prompt tokens until the caches hold the first `upto` of them, or fewer where
        `interrupt` stops it (see `MlxAutoregressiveBinding.prefill`); a chunk an interrupt
        stopped before is the caller's to finish first (`finish_chunk`)."""
        if not self.cached <= upto <= self.prefill_end:
            raise ValueError(f"prefill to {upto} is outside [{self.cached}, {self.prefill_end}]")
        fed = self.binding.prefill(self.prompt[self.cached : upto], self.caches, chunk, on_chunk, interrupt)
        self.cached += fed.tokens
        self.unevaluated, self._layer = fed.unevaluated, fed.layer

    def finish_chunk(self, interrupt: Interrupt | None = None) -> bool:
        """Evaluate what an interrupt left of the last prefill chunk (at least one more layer,
        unless none is left); whether nothing is left."""
        if self.unevaluated:
            self._layer = evaluate_layers(self.caches, interrupt, self._layer)
            if self._layer == len(self.caches):
                self.unevaluated = 0
                mx.clear_cache()  # as after every evaluated chunk (see `MlxAutoregressiveBinding.prefill`)
        return not self.unevaluated

    def take_pending(self) -> TokenStep | None:
        """A resumed sequence's first token (no step runs for it); None otherwise."""
        if self._pending is None:
            return None
        token, self._pending = self._pending, None
        self._next = mx.array([token], dtype=mx.uint32)
        step = TokenStep(token, self.step, mx.zeros((0,)))
        self.step += 1
        return step

    def decode_input(self) -> mx.array:
        """The (1,) token the next decode step feeds into this sequence's caches."""
        assert self._next is not None and self.prefill_left == 0 and self._pending is None
        return self._next

    def join_input(self) -> mx.array:
        """The prompt's rest and its last token, fed in the step that samples the first token,
        instead of a prefill and then `decode_input()` (the same values where one forward over
        several positions is bitwise single steps); `draw` samples from the last position's
        logits. From here on the prompt counts as fed."""
        if self.unevaluated or self._pending is not None or self.prefill_left < 1:
            raise ValueError("only an unstarted or evenly stopped prefill with prompt tokens left joins a step")
        tokens = self.prompt[self.cached :]
        self.cached = self.prefill_end
        return mx.array(tokens, dtype=mx.uint32)

    def round_input(self, drafts: Sequence[int]) -> mx.array:
        """The (1 + len(drafts),) tokens a speculative round feeds: the pending token, then the
        drafts; the round stays open until `end_round`."""
        assert self._round is None, "a speculative round is already open"
        fed = [_token(self.decode_input()), *drafts]
        self._round = (Round(self.caches, len(fed), self.binding.replays_recurrence), fed)
        return mx.array(fed, dtype=mx.uint32)

    def sample_round(self, logits: mx.array) -> list[TokenStep]:
        """Tokens from the (L, vocab) logits of the open round: position i's sample, while the
        previous sample equals the draft fed at position i (see `speculative/speculation.py`)."""
        assert self._round is not None
        fed = self._round[1]
        steps = [self.sample(logits[0:1])]
        for i in range(1, len(fed)):
            if steps[-1].token != fed[i]:
                break
            steps.append(self.sample(logits[i : i + 1]))
        return steps

    def end_round(self, kept: int) -> None:
        """Close the round keeping its first `kept` fed positions (the pending token and the
        drafts accepted before the last token taken)."""
        assert self._round is not None
        current, fed = self._round
        self._round = None
        current.keep(kept, fed, self.binding.feed)

    def sample(self, logits: mx.array) -> TokenStep:
        """The token sampled from (1, vocab) `logits` of feeding `decode_input()` (evaluated)."""
        return self.take(self.draw(logits))

    def draw(self, logits: mx.array) -> Drawn:
        """Sampling's graph for (1, vocab) `logits` of feeding `decode_input()`, not evaluated
        (a batched step evaluates every row's at once); `take` it next."""
        fed = self.decode_input()
        if self._constraint is not None:
            if self.step > self._first_step:  # `fed` was generated (at step - 1), not the prompt's end
                self._constraint.consume(_token(fed))
            logits = self._constraint.apply(logits)
        if self._window:
            self._history = mx.concatenate([self._history, fed.astype(mx.int32)])[-self._window :]
        for processor in self._processors:
            logits = processor(self._history, logits)
        logprobs = self.binding.log_softmax(logits)
        return self._sampler(logprobs, self.step), logprobs

    def draw_ahead(self, logits: mx.array) -> Ahead:
        """`draw`, and make its token, not evaluated, the one the next step feeds: a pipelined
        step builds the next step on it while this one evaluates (values are the same either
        way); `read` it next, or `retreat` to before it."""
        previous, history = self.decode_input(), self._history
        ahead = Ahead(self.draw(logits), self.step, previous, history)
        self._next = ahead.drawn[0].astype(mx.uint32)
        self.step += 1
        return ahead

    def read(self, ahead: Ahead) -> TokenStep:
        """The token `draw_ahead` drew (evaluated here if it is not yet)."""
        y, logprobs = ahead.drawn
        mx.eval(y, logprobs)
        return TokenStep(_token(y), ahead.step, logprobs.squeeze(0))

    def retreat(self, ahead: Ahead) -> None:
        """Back to before `ahead` was drawn: its token and every later one unread. The tokens fed
        since are the caller's to trim."""
        self._next, self._history, self.step = ahead.previous, ahead.history, ahead.step

    @property
    def constrained(self) -> bool:
        """Whether a grammar masks the steps (its state needs each token's value)."""
        return self._constraint is not None

    def take(self, drawn: Drawn) -> TokenStep:
        """The token of `draw`'s graph (evaluated here if it is not yet): the next step feeds it."""
        y, logprobs = drawn
        mx.eval(y, logprobs)
        self._next = y.astype(mx.uint32)
        step = TokenStep(_token(y), self.step, logprobs.squeeze(0))
        self.step += 1
        return step


class Decoder:
    """One sequence's decode steps (a token, or a speculative round's positions): compiled
    while they work, else the graph (single steps and rounds fall back separately)."""

    def __init__(self, binding: MlxAutoregressiveBinding, caches: list[LayerCache], compiled: bool) -> None:
        self._binding = binding
        self._caches = caches
        self.compiled = compiled
        self.compiled_rounds = compiled
        self.traced = False  # whether the last call traced a compiled step (its time is no step's)

    def __call__(self, tokens: mx.array) -> mx.array:
        """(L, vocab) logits of feeding the L 1-D `tokens`."""
        single = tokens.size == 1
        self.traced = False
        if self.compiled if single else self.compiled_rounds:
            try:
                logits = self._binding.decode_compiled(tokens, self._caches)
            except Exception as e:  # noqa: BLE001 - any trace failure means: run this graph uncompiled
                log.warning("compiled %s disabled for this generation: %s: %s", "decode" if single else "rounds",
                            type(e).__name__, e)
                if single:
                    self.compiled = False
                else:
                    self.compiled_rounds = False
            else:
                if logits is not None:
                    self.traced = self._binding.compiled_step_traced
                    return logits
        if single:
            return self._binding.decode(tokens, self._caches)
        return self._binding.decode_positions(tokens, self._caches)


def _token(y: mx.array) -> int:
    value = y.item()
    assert isinstance(value, int)
    return value
