"""The `speculative` request field (both APIs): {"mode": "prompt_lookup" | "draft" | "off",
"num_draft_tokens": k}, each part optional."""

from __future__ import annotations

from typing import Any, get_args

from mlxkv_serve.engine import Speculation, SpeculativeMode
from mlxkv_serve.errors import RequestError

MAX_DRAFT_TOKENS = 32
MODES: tuple[str, ...] = get_args(SpeculativeMode)


def speculation(body: dict[str, Any]) -> Speculation:
    raw = body.get("speculative")
    if raw is None:
        return Speculation()
    if not isinstance(raw, dict):
        raise RequestError(400, "'speculative' must be an object such as {\"mode\": \"prompt_lookup\", \"num_draft_tokens\": 6}",
                           "speculative")
    unknown = sorted(set(raw) - {"mode", "num_draft_tokens"})
    if unknown:
        raise RequestError(400, f"'speculative' has unknown fields {', '.join(unknown)}; allowed: mode, num_draft_tokens",
                           "speculative")
    mode = raw.get("mode")
    if mode is not None and mode not in MODES:
        raise RequestError(400, f"'speculative.mode' must be one of {', '.join(MODES)}", "speculative.mode")
    k = raw.get("num_draft_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS):
        raise RequestError(400, f"'speculative.num_draft_tokens' must be an integer in [1, {MAX_DRAFT_TOKENS}]",
                           "speculative.num_draft_tokens")
    return Speculation(mode, k)
