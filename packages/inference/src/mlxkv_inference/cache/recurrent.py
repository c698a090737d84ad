"""Recurrent state (convolution and SSM/linear-attention arrays) for hybrid and Mamba-like layers.

The state summarises every token seen, so it cannot be trimmed and holds no per-token bytes.
Speculative rounds snapshot the state (MLX arrays are immutable, so a snapshot is a list of
references). Keeping part of a round restores the pre-round state and feeds the kept positions
again: through the layer's recurrence alone where its layer recorded how on the round's forward
(`cache/recurrent_replay.py`), else the round feeds the kept tokens through the whole model.
Both are bitwise what single steps give where the model passed the probes (see
`speculative/speculation.py` and `MlxAutoregressiveBinding.verifies_positions`).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mlxkv_inference.cache.contract import CacheTrimError, DecodePhase, DecodePlan
from mlxkv_inference.cache.stand_ins import RecurrentStandIn


class RecurrentCache:
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"recurrent cache size must be >= 1, got {size}")
        self.cache: list[mx.array | None] = [None] * size
        self.lengths: mx.array | None = None
        self.left_padding: mx.array | None = None
        self.offset = 0  # tokens fed, counted by the binding (models do not all report it)
        self._round: tuple[list[mx.array | None], int] | None = None
        self._recording = False  # the open round takes a layer's replay
        self._replay: Callable[[int], None] | None = None

    # -- mlx-lm cache interface -------------------------------------------------------------
    def __getitem__(self, index: int) -> mx.array | None:
        return self.cache[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.cache[index] = value

    def advance(self, n: int) -> None:
        """Called by mlx-lm layers after consuming `n` tokens (only batching state moves)."""

    def make_mask(self, n: int) -> None:
        return None

    def empty(self) -> bool:
        return self.cache[0] is None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache if c is not None)

    @property
    def state(self) -> list[mx.array | None]:
        return self.cache

    def count_tokens(self, n: int) -> None:
        self.offset += n

    # -- contract ------------------------------------------------------------------------
    @property
    def minimum_reusable_offset(self) -> int:
        # Only reusable at exactly the point it summarises.
        return self.offset

    def signature(self) -> str:
        return "recurrent.arrays/1"

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int, bypass: bool = False) -> int:
        if n == 0:
            return 0
        raise CacheTrimError(f"recurrent state cannot be trimmed (asked to drop {n} of {self.offset} tokens)")

    def bytes_per_token(self) -> int:
        return 0

    def decode_phase(self) -> DecodePhase:
        return "ring"

    def prepare_decode_step(self, rows: int = 1) -> DecodePlan | None:
        if any(c is None for c in self.cache) or rows != 1:
            return None
        return DecodePlan("ring", 0, 0, self.offset)

    def decode_stand_in(self, plan: DecodePlan) -> RecurrentStandIn:
        return RecurrentStandIn(len(self.cache))

    def decode_inputs(self, plan: DecodePlan) -> list[mx.array]:
        states = [c for c in self.cache if c is not None]
        return [*states, mx.array(plan.offset, dtype=mx.int32)]

    def commit_decode_step(self, plan: DecodePlan, outputs: list[mx.array]) -> None:
        self.cache = list(outputs)
        self.offset = plan.offset + 1

    def dispose(self) -> None:
        self.cache = [None] * len(self.cache)
        self.offset = 0
        self._close_round()

    def clone(self) -> RecurrentCache:
        other = RecurrentCache(len(self.cache))
        other.cache = [None if c is None else c[...] for c in self.cache]
        other.offset = self.offset
        return other

    def compact(self) -> None:
        """Nothing to drop: the state has a fixed size whatever the tokens."""

    # -- speculative rounds --------------------------------------------------------------------
    def spec_round_begin(self, replayable: bool = False) -> None:
        """Open a round; `replayable`: its layer may record how to feed positions again alone."""
        if self._round is not None:
            raise RuntimeError("a speculative round is already open")
        self._round = (list(self.cache), self.offset)
        self._recording = replayable

    @property
    def recording(self) -> bool:
        """Whether the open round still waits for its layer's replay."""
        return self._recording and self._replay is None

    def record_replay(self, replay: Callable[[int], None]) -> None:
        """Called by the layer on the round's forward: `replay(n)` feeds the round's first `n`
        positions through this layer's recurrence again, into this cache."""
        if self.recording:
            self._replay = replay

    @property
    def replayable(self) -> bool:
        return self._round is not None and self._replay is not None

    def spec_round_commit(self) -> None:
        self._close_round()

    def spec_round_rollback(self) -> None:
        """Restore the pre-round state (the caller feeds the round's kept tokens again)."""
        if self._round is None:
            raise RuntimeError("no speculative round is open")
        self.cache, self.offset = list(self._round[0]), self._round[1]
        self._close_round()

    def spec_round_replay(self, n: int) -> None:
        """Restore the pre-round state and feed the round's first `n` positions again through
        the recorded replay (not evaluated)."""
        replay = self._replay
        if replay is None:
            raise RuntimeError("no replay was recorded for the open round")
        self.spec_round_rollback()
        replay(n)
        self.offset += n  # the layer does not count tokens (the binding does, on its forwards)

    def _close_round(self) -> None:
        self._round = None
        self._recording = False
        self._replay = None
