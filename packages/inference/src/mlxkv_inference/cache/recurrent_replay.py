"""Recurrent layers that can feed a speculative round's kept positions again by themselves.

Rolling back part of a round on a hybrid model used to mean feeding the kept tokens through the
whole model again (every attention layer, MLP and the head) only to rebuild the recurrent states.
A recurrent mixer given `RecurrentReplayMixin` records, on a round's forward, its own input (the
hidden states of the round's positions at that layer); keeping the first n positions then runs
just that mixer on the first n recorded positions from its pre-round state. Only the recurrent
state is evaluated, so MLX computes the projections, convolution and recurrence the state needs,
not the mixer's output.

Exact where a position's hidden states do not depend on how many positions a forward holds (what
`verifies_positions` probes); the binding also probes the replay itself against the full refeed
and keeps the refeed where they differ.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference.cache.recurrent import RecurrentCache
from mlxkv_inference.mixins import mix_into

__all__ = ["use_recurrent_replay"]

# mlx-lm recurrent mixers called as mixer(x, [mask,] cache): x (B, L, hidden) positional first, the
# layer's cache among the other arguments, every other argument None on a single sequence.
_MIXERS = (
    ("mlx_lm.models.qwen3_next", "Qwen3NextGatedDeltaNet"),
    ("mlx_lm.models.qwen3_5", "GatedDeltaNet"),
    ("mlx_lm.models.mamba", "MambaBlock"),
    ("mlx_lm.models.mamba2", "Mamba2Block"),
    ("mlx_lm.models.nemotron_h", "NemotronHMamba2Mixer"),
    ("mlx_lm.models.granitemoehybrid", "GraniteMoeHybridMamba2Mixer"),
)


class RecurrentReplayMixin:
    """Mixed into an mlx-lm recurrent mixer class: the same forward, recording on a round's
    multi-position forward how to feed its first n positions again into the same cache."""

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        forward = super().__call__  # type: ignore[misc]  # the mlx-lm mixer this is mixed into
        others = (*args, *kwargs.values())
        cache = next((a for a in others if isinstance(a, RecurrentCache)), None)
        if cache is not None and cache.recording and x.ndim == 3 and x.shape[0] == 1 and x.shape[1] > 1 \
                and all(a is None or a is cache for a in others):
            cache.record_replay(lambda n: forward(x[:, :n], *args, **kwargs))
        return forward(x, *args, **kwargs)


def use_recurrent_replay(model: nn.Module) -> bool:
    """Gives every recurrent mixer of `model` whose class is a known mlx-lm mixer the replay;
    returns whether any got it."""
    return mix_into(model, _MIXERS, RecurrentReplayMixin, "Replayable")
