"""The engine Protocol the HTTP layer is written against, and the values it exchanges.

The server never sees model code: it hands a `GenerateRequest` to `ServeEngine.submit` and reads
`Delta`s and then one `Finished` (or one `Failed`) from the returned handle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made (or made earlier, in the history): `arguments` is JSON object text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; `parameters` is its JSON schema as JSON text."""

    name: str
    description: str
    parameters: str


ToolChoice = Literal["auto", "none", "required"]
ConstraintKind = Literal["json_schema", "lark", "regex"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the generated text must match: a JSON schema (JSON text), a Lark grammar or a regex."""

    kind: ConstraintKind
    source: str


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


SpeculativeMode = Literal["off", "prompt_lookup", "draft"]


@dataclass(frozen=True, slots=True)
class Speculation:
    """A request's `speculative` field: None parts take the server's defaults. The tokens are the
    same whatever it says; only how fast they come changes."""

    mode: SpeculativeMode | None = None
    num_draft_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Exactly one of `messages` (chat, templated), `prompt` (text) or `prompt_tokens` (ids)."""

    max_tokens: int
    sampling: Sampling
    # `max_tokens` is the server's default, not the client's: the engine lowers it to the room the
    # prompt leaves in the context instead of refusing a prompt that fits.
    default_max_tokens: bool = False
    messages: tuple[ChatMessage, ...] | None = None
    # With `messages`: the start of the answer (Anthropic's final assistant message): the prompt
    # ends with it and the generated text continues it.
    answer_start: str = ""
    prompt: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only
    constraint: Constraint | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None  # the one tool the answer must call (tool_choice naming a function)
    parallel_tool_calls: bool = True
    speculative: Speculation = field(default_factory=Speculation)
    model: str | None = None  # the request's `model`: which model serves it, on a server with several


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    reasoning: str = ""  # the model's thinking (a reasoning model's think section), apart from text
    logprobs: tuple[TokenLogprob, ...] = ()


FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]


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
    resumed_tokens: int = 0  # tokens generated before a restart, restored from a checkpoint (not prompt)
    tool_calls: tuple[ToolCall, ...] = ()  # finish_reason is "tool_calls" when there are any
    draft_tokens: int = 0  # speculative drafts verified
    accepted_tokens: int = 0  # of those, accepted


@dataclass(frozen=True, slots=True)
class Failed:
    """The generation raised (the engine logged the traceback); the text sent so far is incomplete."""

    generation_id: str
    message: str


Event = Delta | Finished | Failed


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

    def events(self) -> AsyncIterator[Event]: ...

    def cancel(self) -> None: ...


class PromptTooLongError(ValueError):
    """The prompt leaves no room for an answer in the model's context."""


class QueueFullError(Exception):
    """The engine's request queue is full: the client should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownModelError(LookupError):
    """The request names a model this server does not serve (and there is no default)."""


class ModelUnavailableError(Exception):
    """The model cannot be loaded now (its load failed, or it does not fit the memory budget)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServeEngine(Protocol):
    @property
    def model_id(self) -> str: ...

    async def submit(self, request: GenerateRequest) -> GenerationHandle:
        """Queue a generation; raises `ValueError` (or `PromptTooLongError`) for a bad request,
        `QueueFullError` when too many requests wait. Work that grows with the prompt
        (tokenizing) must not hold up the event loop."""
        ...

    async def count_tokens(self, request: GenerateRequest) -> int:
        """The prompt tokens `request` would have (the same template and tokenizer as `submit`);
        raises `ValueError` for a request `submit` would refuse before generating."""
        ...

    def queue_depth(self) -> int:
        """Requests waiting for the engine (not counting the running ones)."""
        ...

    def batch_size(self) -> int:
        """Generations the engine is running together now."""
        ...

    def cache_stats(self) -> Mapping[str, int | float]: ...

    def flush(self, timeout: float) -> FlushResult:
        """Wait until every pending cache and checkpoint write has finished (or `timeout`)."""
        ...

    def generation_state(self, generation_id: str) -> Mapping[str, object] | None: ...

    def close(self, timeout: float) -> None: ...


@runtime_checkable
class HealthReporting(Protocol):
    """An engine that can be up but degraded (a shared cache tier down: requests are served cold)."""

    def health(self) -> str:
        """"ok" or "degraded"."""
        ...


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model a server with several serves, for /v1/models. `state`: "unloaded", "loading",
    "loaded" or "failed" (`error` says why)."""

    name: str
    state: str
    pinned: bool = False
    error: str | None = None


@runtime_checkable
class ModelCatalog(Protocol):
    """An engine serving several models, each request by its `model`."""

    def models(self) -> tuple[ModelInfo, ...]: ...

    def resolve(self, asked: str | None) -> str:
        """The name of the model that serves a request asking for `asked`; raises
        `UnknownModelError` when none does."""
        ...
