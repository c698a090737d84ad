"""Anthropic's `thinking` field and the per-request text Claude Code puts first in its prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mlxkv_serve.errors import RequestError

MIN_BUDGET = 1024  # Anthropic refuses a smaller budget_tokens
BILLING_HEADER = "x-anthropic-billing-header:"
ThinkingKind = Literal["enabled", "disabled", "adaptive"]


@dataclass(frozen=True, slots=True)
class Thinking:
    """What a request asked of the model's thinking: `budget` tokens at most (None: no bound)."""

    kind: ThinkingKind
    budget: int | None = None


def thinking(raw: Any, max_tokens: int | None) -> Thinking | None:
    """The `thinking` field checked as Anthropic checks it: `budget_tokens` in [1024, max_tokens)."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise RequestError(400, "thinking: must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"disabled\"} "
                           "or {\"type\": \"adaptive\"}", "thinking")
    assert isinstance(raw, dict)
    if kind != "enabled":
        return Thinking(kind)
    budget = raw.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_BUDGET:
        raise RequestError(400, f"thinking.budget_tokens: must be an integer >= {MIN_BUDGET}, got {budget!r}", "thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise RequestError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})", "thinking")
    return Thinking("enabled", budget)


def is_billing_header(block: Any) -> bool:
    """Claude Code's first system block, `x-anthropic-billing-header: cc_version=2.1.328.b7f;
    cc_entrypoint=sdk-cli;`: its suffix changes between requests and it tells the model nothing."""
    return isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str) \
        and block["text"].startswith(BILLING_HEADER)
