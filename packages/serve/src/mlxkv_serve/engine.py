"""The engine Protocol the HTTP layer is written against, and the values it exchanges.

The server never sees model code: it hands a `GenerateRequest` to `ServeEngine.submit` and reads
`Delta`s and then one `Finished` (or one `Failed`) from the returned handle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
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
    reasoning: str = ""  # an assistant turn's reasoning as the client sent it back (templates decide whether to show it)


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
    # A reasoning model's thinking: `enable_thinking` reaches templates that take it (None: their
    # default); its think section is closed after `thinking_budget` tokens (None: no bound).
    enable_thinking: bool | None = None
    thinking_budget: int | None = None
    reasoning_effort: str | None = None  # reaches templates that take it (gpt-oss: "low", "medium", "high")
    model: str | None = None  # which model serves it (on a server with several); it may name adapters (`NAME`, `<model id>:NAME`)
    adapters: tuple[str, ...] = ()  # mlx_lm.server's `adapters`: adapter names (or the paths they were loaded from)


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
    writes finished since the previous flush; `remote_failed` the copies to a shared cache tier
    that failed since then (those states are on this replica's SSD only)."""

    settled: bool
    written: int
    failed: int
    remote_failed: int = 0

    @property
    def durable(self) -> bool:
        return self.settled and self.failed == 0 and self.remote_failed == 0


class GenerationHandle(Protocol):
    generation_id: str
    prompt_tokens: int

    def events(self) -> AsyncIterator[Event]: ...

    def cancel(self) -> None: ...


class PromptTooLongError(ValueError):
    """The prompt leaves no room for an answer in the model's context."""


class UnknownModelError(LookupError):
    """The request names a model or adapter the server does not have (a 404); `param` is the field."""

    def __init__(self, message: str, param: str = "model") -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(Exception):
    """The engine's request queue is full: the client should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """How much of a prompt an engine holds now: what a router needs to send it where it is hot."""

    prompt_tokens: int | None  # None: not known (a server with several models, asked about one not loaded)
    cached_tokens: int
    tier: str | None  # "ram", "ssd" or "remote" (a shared tier); None when nothing is held
    model: str | None = None  # on a server with several models: the one that answered
    state: str | None = None  # and its state ("loaded", "unloaded", ...: see `ModelInfo`)


@runtime_checkable
class PrefixLookup(Protocol):
    """An engine that can say, from its indexes alone, how much of a prompt it holds."""

    async def cached_prefix(self, request: GenerateRequest) -> CachedPrefix:
        """Raises `ValueError` for a request `submit` would refuse before generating."""
        ...


@runtime_checkable
class HealthReporting(Protocol):
    """An engine that can be up but degraded (a shared cache tier down: requests are served cold)."""

    def health(self) -> str:
        """"ok" or "degraded"."""
        ...


@runtime_checkable
class MemoryReporting(Protocol):
    """An engine under a memory budget: the budget, what it planned and what the process holds."""

    def memory(self) -> Mapping[str, int | None]:
        """Byte counts by name (`budget_bytes`, `planned_bytes`, `measured_bytes`, ...; None: not measured)."""
        ...


@runtime_checkable
class AdapterServing(Protocol):
    """An engine with adapters a request can select (`/v1/models` lists them as `<model id>:NAME`)."""

    def adapter_names(self) -> Sequence[str]:
        """The loaded adapters' names, sorted."""
        ...


@runtime_checkable
class AdapterManaging(Protocol):
    """An engine whose adapters clients may add and remove (`POST /v1/adapters`, `DELETE /v1/adapters/{name}`)."""

    async def add_adapter(self, name: str, path: str, model: str | None = None) -> Mapping[str, object]:
        """Load the adapter at `path` as `name` for `model` (with several models; None: the
        default one); raises PermissionError for a path the operator did not allow, ValueError for
        a bad name or adapter, `UnknownModelError` for a model the server does not have."""
        ...

    async def remove_adapter(self, name: str, model: str | None = None) -> str | None:
        """Forget `model`'s adapter `name`; the id it was listed under, None when it has no such adapter."""
        ...


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model a server with several serves, for /v1/models. `state`: "unloaded", "loading",
    "loaded" or "failed" (`error` says why)."""

    name: str
    state: str
    pinned: bool = False
    error: str | None = None
    health: str | None = None  # a loaded model's own health ("ok" or "degraded"); None when not loaded
    adapters: tuple[str, ...] = ()  # its adapters' names (a request selects one as `<name>:ADAPTER`)


@runtime_checkable
class ModelCatalog(Protocol):
    """An engine serving several models, each request by its `model`."""

    def models(self) -> tuple[ModelInfo, ...]: ...

    def resolve(self, asked: str | None) -> str:
        """The name of the model that serves a request asking for `asked`; raises
        `UnknownModelError` when none does."""
        ...
