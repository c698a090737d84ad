"""Server settings (from the CLI)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServeConfig:
    vocab_size: int
    default_max_tokens: int = 512
    max_tokens_limit: int = 32768
    default_temperature: float = 0.0
    default_top_p: float = 1.0
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    flush_timeout_s: float = 30.0
    # What runs the model's matmuls, reported by /health (set by the app that loads the model).
    cpu_kernels: str = "unknown"
    blas: str = "unknown"

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError(f"default max tokens={self.default_max_tokens} must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max body bytes={self.max_body_bytes} must be >= 1024")
