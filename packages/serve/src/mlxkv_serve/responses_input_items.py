"""`GET /v1/responses/{id}/input_items`: a stored response's input items (the conversation it
answered: earlier responses' items included), in OpenAI's list shape, paged by `after` / `limit`
in `order` (newest first by default)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxkv_serve.errors import RequestError
from mlxkv_serve.responses_store import StoredResponse

DEFAULT_LIMIT, MAX_LIMIT = 20, 100
_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_item_page(stored: StoredResponse, query: Mapping[str, str]) -> dict[str, Any]:
    """One page of `stored`'s input items; a bad `order`, `limit` or `after` is a 400."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError(400, f"'order' must be 'asc' or 'desc', got {order!r}", "order")
    limit = _limit(query.get("limit"))
    listed = input_items(stored)
    if order == "desc":
        listed.reverse()
    start = 0
    after = query.get("after")
    if after is not None:
        ids = [entry["id"] for entry in listed]
        if after not in ids:
            raise RequestError(400, f"'after' {after!r} is not an input item of response '{stored.id}'", "after")
        start = ids.index(after) + 1
    page = listed[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(listed)}


def input_items(stored: StoredResponse) -> list[dict[str, Any]]:
    """The items before the response's own output, oldest first, each with an id (its own, else
    one derived from the response's id and its place in the conversation)."""
    outputs = len(stored.response.get("output") or ())
    inputs = stored.items[:len(stored.items) - outputs]
    suffix = stored.id.removeprefix("resp_")
    return [_listed(entry, f"{_PREFIXES.get(str(entry.get('type')), 'item')}_{suffix}_{i}") for i, entry in enumerate(inputs)]


def _listed(entry: Mapping[str, Any], derived_id: str) -> dict[str, Any]:
    out = {"id": derived_id, **entry}
    if out.get("type") == "message":
        out.setdefault("status", "completed")
    return out


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise RequestError(400, f"'limit' must be an integer in [1, {MAX_LIMIT}], got {raw!r}", "limit")
    return int(raw)
