"""The engine Protocol the HTTP layer is written against, and the values it exchanges.

The server never sees model code: it hands a `GenerateRequest` to `ServeEngine.submit` and reads
`Delta`s and one `Finished` from the returned handle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Exactly one of `messages` (chat, templated), `prompt` (text) or `prompt_tokens` (ids)."""

    max_tokens: int
    sampling: Sampling
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: FinishReason
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    seed: int
    generation_id: str
    ttft_s: float


@dataclass(frozen=True, slots=True)
class FlushResult:
    """A flush: `settled` when no write was pending any more; `written` and `failed` count the
    writes finished since the previous flush."""

    settled: bool
    written: int
    failed: int

    @property
    def durable(self) -> bool:
        return self.settled and self.failed == 0


class GenerationHandle(Protocol):
    generation_id: str
    prompt_tokens: int

    def events(self) -> AsyncIterator[Delta | Finished]: ...

    def cancel(self) -> None: ...


class PromptTooLongError(ValueError):
    """The prompt plus the requested tokens do not fit the model's context."""


class ServeEngine(Protocol):
    @property
    def model_id(self) -> str: ...

    def submit(self, request: GenerateRequest) -> GenerationHandle:
        """Queue a generation; raises `ValueError` (or `PromptTooLongError`) for a bad request."""
        ...

    def cache_stats(self) -> Mapping[str, int | float]: ...

    def flush(self, timeout: float) -> FlushResult:
        """Wait until every pending cache and checkpoint write has finished (or `timeout`)."""
        ...

    def generation_state(self, generation_id: str) -> Mapping[str, object] | None: ...

    def close(self, timeout: float) -> None: ...
