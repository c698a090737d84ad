"""How a generation speculates (`SpeculativeParams`). A speculative round (`cache/rounds.py`):
feed the pending token and k drafted ones in one forward, keep what the target would have
sampled anyway, and roll the caches back to exactly that.

    round   feed  p  d0 d1 ... d(k-1)        (L = k + 1 positions, one forward)
            logits of each position -> the target's own sample y_i at step s + i
            accept d_i while y_i == d_i; y_a (first mismatch, or y_k) is the new pending token
    keep    p d0 ... d(a-1)                  (n = a + 1 fed positions; the rest are rolled back)

The accepted tokens are exactly the non-speculative run's: sample i of a round sees the logits a
lone decode step would see (a model is only verified this way once a probe has found its
multi-position forward bitwise equal to single steps; `round_fits` keeps rounds out of the cache
states where that does not hold), and the sampler's key depends on (seed, step) alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SpeculativeMode = Literal["off", "prompt_lookup", "draft"]
SPECULATIVE_MODES: tuple[SpeculativeMode, ...] = ("off", "prompt_lookup", "draft")
DEFAULT_NUM_DRAFT_TOKENS = 6
MAX_NUM_DRAFT_TOKENS = 32


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
