"""What a generation takes and gives: its parameters, its text as it comes, its result, and the
state a checkpoint keeps and a resumed generation starts from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx

from mlxkv_inference.binding import DEFAULT_PREFILL_CHUNK
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.generation.constraint import Grammar
from mlxkv_inference.generation.loop import TokenStep
from mlxkv_inference.generation.sampling import SamplingParams
from mlxkv_inference.speculative.proposers import DraftState
from mlxkv_inference.speculative.speculation import SpeculativeParams

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
