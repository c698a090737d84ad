"""mlx-lm's attention mask for `n` new positions after `offset` cached ones, as an array."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["mlx_causal"]


def mlx_causal(n: int, offset: int, window_size: int | None) -> mx.array:
    right = mx.arange(offset + n)
    left = (mx.arange(offset, offset + n) if offset else right)[:, None]
    mask = left >= right[None]
    if window_size is not None:
        mask = mask & (left < right[None] + window_size)
    return mask
