"""Speculative rounds: feed the pending token and k drafted ones in one forward, keep what the
target would have sampled anyway, and roll the caches back to exactly that.

    round   feed  p  d0 d1 ... d(k-1)        (L = k + 1 positions, one forward)
            logits of each position -> the target's own sample y_i at step s + i
            accept d_i while y_i == d_i; y_a (first mismatch, or y_k) is the new pending token
    keep    p d0 ... d(a-1)                  (n = a + 1 fed positions; the rest are rolled back)

The accepted tokens are exactly the non-speculative run's: sample i of a round sees the logits a
lone decode step would see (a model is only verified this way once a probe has found its
multi-position forward bitwise equal to single steps; `round_fits` keeps rounds out of the cache
states where that does not hold), and the sampler's key depends on (seed, step) alone.

Rolling back: KV caches drop the rejected positions by trimming; recurrent caches go back to
their pre-round state and the kept positions are fed again: through each recurrent layer alone,
from the inputs it recorded on the round's forward (`cache/recurrent_replay.py`, where the binding
probed it exact), else through the whole model in one forward (exact for the same reason).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.kv import RotatingKVCache
from mlxkv_inference.cache.quantized import QuantizedKVCache
from mlxkv_inference.cache.recurrent import RecurrentCache
from mlxkv_inference.kv_scheme import KvScheme

SpeculativeMode = Literal["off", "prompt_lookup", "draft"]
SPECULATIVE_MODES: tuple[SpeculativeMode, ...] = ("off", "prompt_lookup", "draft")
DEFAULT_NUM_DRAFT_TOKENS = 6
MAX_NUM_DRAFT_TOKENS = 32
PRIOR_POSITION_COST = 0.15  # cost of one more verified position, as a fraction of a step, until measured

# Feeds tokens into caches through the model, evaluated (a rolled-back round's kept positions).
Refeed = Callable[[list[int], list[LayerCache]], int]


@dataclass(frozen=True, slots=True)
class SpeculativeParams:
    """How a generation speculates: its proposer and the most drafts a round may verify (the
    adaptive length chooses up to that; `adaptive=False` always drafts as many as it can)."""

    mode: SpeculativeMode = "off"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    ngram_max: int = 8  # prompt lookup: the longest suffix n-gram matched (tried first)
    ngram_min: int = 1
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative mode={self.mode!r} is not one of {', '.join(SPECULATIVE_MODES)}")
        if not 1 <= self.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} is out of range; allowed: [1, {MAX_NUM_DRAFT_TOKENS}]")
        if not 1 <= self.ngram_min <= self.ngram_max <= 8:
            raise ValueError(f"n-gram sizes {self.ngram_min}..{self.ngram_max} are out of range; allowed: 1 <= min <= max <= 8")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def round_fits(caches: Sequence[LayerCache], positions: int, kv_scheme: KvScheme) -> int:
    """The most positions (<= `positions`) one forward may verify from the caches' state and
    still see what single steps would, and roll back by trimming: a sliding window must not
    fill (its ring would wrap and its window mask apply), and a plain cache must stay below the
    KV scheme's quantization start (single steps would attend the positions past it quantized)."""
    fits = positions
    for cache in caches:
        if isinstance(cache, RotatingKVCache):
            fits = min(fits, cache.max_size - cache.offset - 1)
        elif kv_scheme.bits is not None and not isinstance(cache, (QuantizedKVCache, RecurrentCache)):
            fits = min(fits, kv_scheme.quantized_start - cache.offset - 1)
    return max(fits, 1)


class Round:
    """One open round over a sequence's caches: `begin` before its forward, `keep(n)` after.
    `replay`: recurrent layers may record how to feed kept positions again by themselves."""

    def __init__(self, caches: list[LayerCache], fed: int, replay: bool = False) -> None:
        self._caches = caches
        self._fed = fed
        self._offsets = [c.offset for c in caches]
        for cache in caches:
            if isinstance(cache, RecurrentCache):
                cache.spec_round_begin(replay)

    def keep(self, n: int, tokens: Sequence[int], refeed: Refeed) -> None:
        """Keep the round's first `n` fed positions (`tokens` are the round's fed tokens)."""
        if not 1 <= n <= self._fed:
            raise ValueError(f"a round keeps 1..{self._fed} positions, not {n}")
        recurrent = [c for c in self._caches if isinstance(c, RecurrentCache)]
        if n == self._fed:
            for state in recurrent:
                state.spec_round_commit()
            return
        if all(state.replayable for state in recurrent):  # none, or every one recorded its replay
            for cache in self._caches:
                if isinstance(cache, RecurrentCache):
                    cache.spec_round_replay(n)
                else:
                    cache.trim(self._fed - n)
            mx.eval([state.state for state in recurrent])
            return
        for layer, start in zip(self._caches, self._offsets):  # back to the round's start, then the kept positions again
            if isinstance(layer, RecurrentCache):
                layer.spec_round_rollback()
            else:
                layer.trim(layer.offset - start)
        refeed(list(tokens[:n]), self._caches)


class StepCosts:
    """Seconds per forward (alone or batched) of `rows` positions in all (decayed averages),
    shared by a binding's generations."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._lock = threading.Lock()
        # seconds(rows) as worked out since the last measurement: every generation's draft length
        # asks for each candidate length, twice a step: ~200 calls a step at eight rows.
        self._worked_out: dict[int, float | None] = {}

    def record(self, rows: int, seconds: float) -> None:
        with self._lock:
            previous = self._seconds.get(rows)
            self._seconds[rows] = seconds if previous is None else 0.8 * previous + 0.2 * seconds
            self._worked_out = {}

    def replace(self, rows: int, seconds: float) -> None:
        """Forget what `rows` measured before (a calibration of another kind of forward)."""
        with self._lock:
            self._seconds[rows] = seconds
            self._worked_out = {}

    def seconds(self, rows: int) -> float | None:
        """Measured seconds for `rows`, else interpolated (or extrapolated) from the nearest
        measured row counts, never below what fewer rows measured (more rows never cost less;
        noisy timings could extrapolate to nothing); None before two row counts are measured."""
        with self._lock:
            worked_out = self._worked_out  # a measurement from now on replaces it, unread
            if rows in worked_out:
                return worked_out[rows]
            known = sorted(self._seconds.items())
        worked_out[rows] = seconds = self._work_out(known, rows)
        return seconds

    @staticmethod
    def _work_out(known: list[tuple[int, float]], rows: int) -> float | None:
        exact = dict(known).get(rows)
        if exact is not None or len(known) < 2:
            return exact
        below = [p for p in known if p[0] < rows]
        above = [p for p in known if p[0] > rows]
        (r0, t0), (r1, t1) = (below[-1], above[0]) if below and above else (known[-2:] if below else known[:2])
        floor = max(t for _, t in below) if below else known[0][1] * rows / known[0][0]
        return max(t0 + (t1 - t0) * (rows - r0) / (r1 - r0), floor)

    def relative(self, rows: int, base: int = 1) -> float:
        """What a forward of `rows` positions costs against one of `base` positions."""
        if rows <= base:
            return 1.0
        few, many = self.seconds(base), self.seconds(rows)
        if few is None or many is None or few <= 0:
            return 1.0 + PRIOR_POSITION_COST * (rows - base) / base
        return max(many / few, 1.0)
