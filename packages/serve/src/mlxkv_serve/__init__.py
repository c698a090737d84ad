"""mlxkv serve: an OpenAI- and Anthropic-compatible HTTP API over an engine Protocol."""

from mlxkv_serve.app import build_app
from mlxkv_serve.config import ServeConfig
from mlxkv_serve.engine import (
    ChatMessage, Delta, Finished, FlushResult, GenerateRequest, GenerationHandle, PromptTooLongError, Sampling, ServeEngine, TokenLogprob,
)
from mlxkv_serve.errors import RequestError

__all__ = [
    "ChatMessage", "Delta", "Finished", "FlushResult", "GenerateRequest", "GenerationHandle", "PromptTooLongError", "RequestError",
    "Sampling", "ServeConfig", "ServeEngine", "TokenLogprob", "build_app",
]
