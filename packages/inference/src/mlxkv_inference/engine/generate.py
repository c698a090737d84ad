"""Text-level generation: the loop plus detokenization, stop conditions and timing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx

from mlxkv_inference.binding import DEFAULT_PREFILL_CHUNK, MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.engine.constraint import Grammar, GrammarConstraint
from mlxkv_inference.engine.detokenizer import IncrementalDetokenizer
from mlxkv_inference.engine.logits import context_window, make_logits_processors
from mlxkv_inference.cache.reuse import covered_tokens, frozen_copy
from mlxkv_inference.engine.loop import PrefillProgress, TokenStep, generate_steps
from mlxkv_inference.engine.sampling import SamplingParams, choose_seed, make_sampler

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
    and the token sampled next, never fed."""

    generated: tuple[int, ...]
    pending: int


@dataclass(frozen=True, slots=True)
class CheckpointState:
    """A consistent snapshot: `caches` hold the prompt and `generated`; `pending` comes next,
    sampled from `pending_logprobs` (over the vocabulary)."""

    generated: tuple[int, ...]
    pending: int
    caches: list[LayerCache]
    seed: int
    pending_logprobs: mx.array


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


class Generation:
    """One generation: iterate for `TextDelta`s, then read `result`.

    Generated token ids exclude the EOS token and any token after a stop string.
    """

    def __init__(
        self,
        binding: MlxAutoregressiveBinding,
        prompt: Sequence[int],
        params: GenerationParams,
        caches: list[LayerCache] | None = None,
        *,
        history: Sequence[int] = (),
        snapshot_at: Sequence[int] = (),
        on_snapshot: Callable[[Sequence[int], list[LayerCache]], None] | None = None,
        resume: ResumePoint | None = None,
        checkpoint_every: int = 0,
        on_checkpoint: Callable[[CheckpointState], None] | None = None,
        on_prefill_progress: PrefillProgress | None = None,
    ) -> None:
        self._binding = binding
        self._on_prefill_progress = on_prefill_progress
        self._params = params
        self.seed = params.sampling.seed if params.sampling.seed is not None else choose_seed()
        self.caches = caches if caches is not None else binding.make_cache()
        self.cached_tokens = covered_tokens(self.caches)
        # `history` restarts a generation: its tokens were generated before, at steps 0..k-1.
        # `resume` continues one from a checkpoint: its caches already hold the generated tokens.
        self._resume = resume
        replayed = list(resume.generated) if resume is not None else list(history)
        self.prompt = list(prompt) + replayed
        self._replayed = replayed
        self._first_step = len(replayed)
        self._original_prompt = len(prompt)
        self._checkpoint_every = checkpoint_every
        self._on_checkpoint = on_checkpoint
        self._tokens: list[int] = []
        self._yielded: list[int] = []  # every token the loop produced, EOS included
        self._snapshot_at = tuple(snapshot_at)
        self._on_snapshot = on_snapshot
        self._detok = IncrementalDetokenizer(binding.tokenizer, params.stop)
        self._finish: FinishReason = "length"
        self._cancelled = False
        self._t0 = 0.0
        self._t_first = 0.0
        self._t_end = 0.0
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[TextDelta]:
        self._t0 = time.perf_counter()
        sampling = self._params.sampling
        if self._resume is not None:
            for token in self._resume.generated:  # the text already generated, sent again first
                self._tokens.append(token)
                self._yielded.append(token)
                yield TextDelta(self._detok.add(token), None)
        steps = generate_steps(
            self._binding,
            self.prompt,
            self.caches,
            sampler=make_sampler(sampling, self.seed),
            max_tokens=self._params.max_tokens - self._first_step if self._resume is not None else self._params.max_tokens,
            processors=make_logits_processors(sampling),
            context_window=context_window(sampling),
            prefill_chunk=self._params.prefill_chunk,
            first_step=self._first_step,
            on_prefill_done=self._mark_first,
            compiled_decode=self._params.compiled_decode,
            snapshot_at=self._snapshot_at,
            on_snapshot=self._snapshot if self._on_snapshot is not None else None,
            resume_pending=self._resume.pending if self._resume is not None else None,
            checkpoint_every=self._checkpoint_every,
            on_checkpoint=self._checkpoint if self._on_checkpoint is not None else None,
            on_prefill_progress=self._on_prefill_progress,
            constraint=self._constraint(),
        )
        step: TokenStep | None = None
        for step in steps:
            if self._cancelled:
                self._finish = "cancelled"
                break
            self._yielded.append(step.token)
            if step.token in self._binding.eos_token_ids and not self._params.ignore_eos:
                self._finish = "stop"
                break
            self._tokens.append(step.token)
            text = self._detok.add(step.token)
            if self._detok.stopped:
                self._finish = "stop"
                yield TextDelta(text, step)
                break
            yield TextDelta(text, step)
        tail = self._detok.finish()
        self._t_end = time.perf_counter()
        self.result = self._make_result()
        if tail:
            yield TextDelta(tail, step)

    def run(self) -> GenerationResult:
        """Consume the whole generation and return its result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def cancel(self) -> None:
        """Stop before the next token (from the thread iterating this generation)."""
        self._cancelled = True

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the generation, if one did."""
        return self._detok.stop_string

    def fed_tokens(self) -> list[int]:
        """The tokens the caches hold now: the prompt and the generated tokens fed so far."""
        return (self.prompt + self._yielded)[: covered_tokens(self.caches)]

    def _constraint(self) -> GrammarConstraint | None:
        grammar = self._params.grammar
        if grammar is None:
            return None
        return GrammarConstraint(grammar, self._binding.tokenizer, replay=self._replayed)

    def _checkpoint(self, pending: int, emitted: int, logprobs: mx.array) -> None:
        assert self._on_checkpoint is not None
        generated = tuple(self._yielded)
        # The caches hold exactly the prompt and `generated` here (the loop calls back between steps).
        copies = frozen_copy(self.caches, covered_tokens(self.caches))
        self._on_checkpoint(CheckpointState(generated, pending, copies, self.seed, logprobs))

    def _snapshot(self, num_tokens: int) -> None:
        assert self._on_snapshot is not None
        self._on_snapshot(self.prompt[:num_tokens], self.caches)

    def _mark_first(self) -> None:
        self._t_first = time.perf_counter()

    def _make_result(self) -> GenerationResult:
        prefilled = len(self.prompt) - self.cached_tokens
        ttft = self._t_first - self._t0
        decode_time = self._t_end - self._t_first
        n = len(self._tokens) - (self._first_step if self._resume is not None else 0)  # decoded in this run
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
        )

