"""Giving mlx-lm module classes a different forward, in place: a mixin class is put in front of
each known class a model's modules have (weights, names and the module tree stay as they are)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import mlx.nn as nn


def mix_into(model: nn.Module, classes: tuple[tuple[str, str], ...], mixin: type, prefix: str,
             where: Callable[[Any], bool] = lambda module: True) -> bool:
    """Gives every module of `model` whose class is one of `classes` (module path, class name;
    those the installed mlx-lm lacks are skipped), and for which `where` holds, `mixin` in front of
    it; returns whether any got it."""
    known = {cls for cls in (_class(module, name) for module, name in classes) if cls is not None}
    mixed: dict[type, type] = {}
    for _, module in model.named_modules():  # type: ignore[no-untyped-call]  # mlx leaves it untyped
        cls = type(module)
        if cls in known and where(module):
            if cls not in mixed:
                mixed[cls] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
            module.__class__ = mixed[cls]
    return bool(mixed)


def _class(module: str, name: str) -> type | None:
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None
