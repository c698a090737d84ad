"""A generation's parts, built from its parameters: the sequence's state and the phases acting
on it, wired to each other once (`Generation` drives them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxkv_inference.binding import MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.generation.checkpoints import CheckpointSchedule
from mlxkv_inference.generation.constraint import GrammarConstraint
from mlxkv_inference.generation.detokenizer import IncrementalDetokenizer
from mlxkv_inference.generation.drafting import Drafting
from mlxkv_inference.generation.hooks import GenerationHooks
from mlxkv_inference.generation.logits import context_window, make_logits_processors
from mlxkv_inference.generation.loop import Decoder, SequenceRun, StepSampling, TokenStep
from mlxkv_inference.generation.prefill import PromptPrefill
from mlxkv_inference.generation.results import GenerationParams, ResumePoint, TextDelta
from mlxkv_inference.generation.run_ahead import RunAhead, Take
from mlxkv_inference.generation.sampling import choose_seed, make_sampler
from mlxkv_inference.generation.sequence import SequenceState
from mlxkv_inference.generation.timing import StepTimer


@dataclass(frozen=True, slots=True)
class GenerationParts:
    sequence: SequenceState
    run: SequenceRun
    decoder: Decoder
    prefill: PromptPrefill
    checkpoints: CheckpointSchedule
    drafting: Drafting
    timer: StepTimer
    take: Take
    ahead: RunAhead


def assemble(binding: MlxAutoregressiveBinding, prompt: Sequence[int], params: GenerationParams,
             caches: list[LayerCache] | None, hooks: GenerationHooks, resume: ResumePoint | None,
             draft: MlxAutoregressiveBinding | None) -> GenerationParts:
    """The parts of one generation of `prompt` (see `Generation`)."""
    seed = params.sampling.seed if params.sampling.seed is not None else choose_seed()
    seq = SequenceState(prompt, caches if caches is not None else binding.make_cache(), seed, params.max_tokens,
                        IncrementalDetokenizer(binding.tokenizer, params.stop), resume)
    run = _make_run(binding, seq, params)
    checkpoints = CheckpointSchedule(hooks.checkpoint_every, hooks.on_checkpoint)
    drafting = Drafting(binding, seq, checkpoints, params.speculative, draft)
    timer = StepTimer()
    take = _taker(binding, params, seq, checkpoints, timer)
    return GenerationParts(
        sequence=seq, run=run, decoder=Decoder(binding, seq.caches, params.compiled_decode),
        prefill=PromptPrefill(binding, run, seq, params.prefill_chunk, hooks), checkpoints=checkpoints,
        drafting=drafting, timer=timer, take=take, ahead=RunAhead(binding, run, seq, checkpoints, drafting, take),
    )


def _taker(binding: MlxAutoregressiveBinding, params: GenerationParams, seq: SequenceState, checkpoints: CheckpointSchedule,
           timer: StepTimer) -> Take:
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
    step_sampling = StepSampling(make_sampler(sampling, seq.seed, binding.native_sampler), make_logits_processors(sampling),
                                 context_window(sampling), constraint)
    return SequenceRun(binding, seq.prompt, seq.caches, step_sampling, first_step=len(replayed),
                       pending=seq.resume.pending if seq.resume is not None else None)
