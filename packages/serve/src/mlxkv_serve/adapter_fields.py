"""A request's adapter selection: its `model`, and mlx_lm.server's `adapters` field (a name or a
path, or a list of them to stack)."""

from __future__ import annotations

from typing import Any

from mlxkv_serve.errors import RequestError

MAX_STACKED = 8


def selection(body: dict[str, Any]) -> dict[str, Any]:
    """GenerateRequest's `model` and `adapters` from a request body (400 for a bad shape)."""
    model = body.get("model")
    raw = body.get("adapters")
    names = [raw] if isinstance(raw, str) else raw if raw is not None else []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names) or len(names) > MAX_STACKED:
        raise RequestError(400, f"'adapters' must be an adapter name or path, or a list of at most {MAX_STACKED}", "adapters")
    return {"model": model if isinstance(model, str) else None, "adapters": tuple(names)}
