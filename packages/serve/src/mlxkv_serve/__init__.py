"""mlxkv serve: an OpenAI- and Anthropic-compatible HTTP API over an engine Protocol."""

from mlxkv_serve.app import build_app
from mlxkv_serve.config import ServeConfig
from mlxkv_serve.connection import bounded_http_protocol
from mlxkv_serve.engine import (
    ChatMessage, Constraint, Delta, Event, Failed, Finished, FlushResult, GenerateRequest, GenerationHandle, PromptTooLongError, QueueFullError, Sampling,
    ServeEngine, Speculation, TokenLogprob, Tool, ToolCall,
)
from mlxkv_serve.engine import ModelCatalog, ModelInfo, ModelUnavailableError, UnknownModelError
from mlxkv_serve.errors import RequestError

__all__ = [
    "ChatMessage", "Constraint", "Delta", "Event", "Failed", "Finished", "FlushResult", "GenerateRequest", "GenerationHandle", "PromptTooLongError",
    "QueueFullError", "RequestError", "Sampling", "ServeConfig", "ServeEngine", "Speculation", "TokenLogprob", "Tool", "ToolCall", "bounded_http_protocol",
    "build_app", "ModelCatalog", "ModelInfo", "ModelUnavailableError", "UnknownModelError",
]
