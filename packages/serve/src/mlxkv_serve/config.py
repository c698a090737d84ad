"""Server settings (from the CLI)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServeConfig:
    vocab_size: int
    default_max_tokens: int = 512
    # The most a request may ask for: a sanity bound only, since the engine lowers `max_tokens` to
    # what the context leaves (agents ask for 32,000 or 128,000 whatever the model).
    max_tokens_limit: int = 1 << 30
    default_temperature: float = 0.0
    default_top_p: float = 1.0
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    flush_timeout_s: float = 30.0
    # None: any Host header. A loopback server lists the names it answers to (DNS rebinding guard).
    allowed_hosts: frozenset[str] | None = None
    # Browser origins (CORS) allowed besides the local ones (`LOCAL_ORIGINS`); "*" allows any web
    # page the user opens to call the API, as mlx_lm.server does.
    cors_origins: tuple[str, ...] = ()
    # Claude Code's first system block (`x-anthropic-billing-header: cc_version=...;`) changes on
    # every request; as the first text of the prompt it would make every prompt a cache miss.
    keep_billing_header: bool = False
    # What runs the model's matmuls, reported by /health (set by the app that loads the model).
    cpu_kernels: str = "unknown"
    blas: str = "unknown"
    # strict or relaxed (`--batch-exactness`): whether batch neighbours may change a sequence's tokens.
    batch_exactness: str = "strict"

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError(f"default max tokens={self.default_max_tokens} must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max body bytes={self.max_body_bytes} must be >= 1024")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty; give a non-empty key, or none to serve without one")


# Pages served from this machine (a local chat front-end on any port) may call the API from a browser.
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def loopback_hosts(host: str) -> frozenset[str] | None:
    """The Host names a server bound to `host` answers to: its address and localhost when `host` is a
    loopback address (a web page can reach those from the user's browser); None (any) otherwise."""
    bare = host.strip("[]")
    try:
        loopback = ipaddress.ip_address(bare).is_loopback
    except ValueError:
        loopback = bare == "localhost"
    if not loopback:
        return None
    if bare == "localhost":  # bound to whichever loopback addresses the name resolves to
        return frozenset({"localhost", "127.0.0.1", "[::1]"})
    return frozenset({"localhost", f"[{bare}]" if ":" in bare else bare})
