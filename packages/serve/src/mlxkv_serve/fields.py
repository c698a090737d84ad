"""Typed, range-checked access to JSON request fields; every failure is a 400 naming the field."""

from __future__ import annotations

import math
from typing import Any

from mlxkv_serve.errors import RequestError

_MISSING = object()


class Fields:
    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        self.body: dict[str, Any] = body

    def number(self, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
        value = self.body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(400, f"'{name}' must be a number", name)
        if value < low or value > high or (low_open and value == low):
            bracket = "(" if low_open else "["
            raise RequestError(400, f"'{name}' must be in {bracket}{low}, {high}], got {value}", name)
        return float(value)

    def integer(self, name: str, default: int | None, low: int, high: int) -> int | None:
        value = self.body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(400, f"'{name}' must be an integer", name)
        if not low <= value <= high:
            raise RequestError(400, f"'{name}' must be in [{low}, {high}], got {value}", name)
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.body.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise RequestError(400, f"'{name}' must be a boolean", name)
        return value

    def string(self, name: str) -> str | None:
        value = self.body.get(name)
        if value is not None and not isinstance(value, str):
            raise RequestError(400, f"'{name}' must be a string", name)
        return value

    def required(self, name: str) -> Any:
        value = self.body.get(name, _MISSING)
        if value is _MISSING or value is None:
            raise RequestError(400, f"'{name}' is required", name)
        return value

    def stop(self, name: str, limit: int) -> tuple[str, ...]:
        value = self.body.get(name)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise RequestError(400, f"'{name}' must be a non-empty string or a list of non-empty strings", name)
        if len(items) > limit:
            raise RequestError(400, f"'{name}' takes at most {limit} sequences, got {len(items)}", name)
        return tuple(items)

    def logit_bias(self, name: str, vocab_size: int) -> dict[int, float]:
        value = self.body.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise RequestError(400, f"'{name}' must map token ids to biases", name)
        out: dict[int, float] = {}
        for key, bias in value.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise RequestError(400, f"'{name}' key {key!r} is not a token id", name) from None
            if not 0 <= token < vocab_size:
                raise RequestError(400, f"'{name}' token id {token} is outside the vocabulary [0, {vocab_size})", name)
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise RequestError(400, f"'{name}' values must be numbers in [-100, 100]", name)
            out[token] = float(bias)
        return out
