"""Draft proposers: where a speculative round's guesses come from.

Drafts only decide how many tokens a round can accept, never which tokens are produced (see
`speculative/speculation.py`), so a proposer may be as approximate as it likes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlxkv_inference.adapters.files import AdapterStack
from mlxkv_inference.binding import DEFAULT_PREFILL_CHUNK, MlxAutoregressiveBinding
from mlxkv_inference.cache.contract import CacheTrimError
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import all_trimmable, common_prefix, covered_tokens, frozen_copy

log = logging.getLogger(__name__)


class Proposer(Protocol):
    def propose(self, history: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens guessed to follow `history` (the prompt and every generated token)."""
        ...


class PromptLookup:
    """Prompt-lookup drafts: the longest suffix n-gram of the history (n from `ngram_max` down to
    `ngram_min`) that occurred before, and the tokens that followed its best-aligned occurrence:
    of its latest `CANDIDATES`, the one whose preceding tokens go on matching the history's
    furthest back (up to `ALIGN_MAX` tokens; ties to the latest). A quoted file repeats short
    n-grams (`self.`, `    def `) in many places, and the latest is not always the text being
    copied: the best-aligned one more often is (`tools.bench_speculative` reports the drafts
    accepted).

    The index grows with the history (a few dict writes a token), so a lookup costs
    O(ngram_max + CANDIDATES * ALIGN_MAX).
    """

    CANDIDATES = 8
    ALIGN_MAX = 64

    def __init__(self, ngram_min: int, ngram_max: int) -> None:  # defaults: SpeculativeParams'
        self._sizes = range(ngram_max, ngram_min - 1, -1)
        self._tokens: list[int] = []
        # n -> n-gram -> starts of its latest occurrences that have a token after them, oldest first
        self._starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self._sizes}

    def _reset(self) -> None:
        self._tokens = []
        self._starts = {n: {} for n in self._sizes}

    def propose(self, history: Sequence[int], limit: int) -> list[int]:
        return self.lookup(history, limit)[0]

    def lookup(self, history: Sequence[int], limit: int) -> tuple[list[int], int]:
        """(`propose`'s drafts, how many tokens before them the copied text matches the history's
        end: the n-gram and its aligned tokens before it; 0 where nothing matched)."""
        self._sync(history)
        tokens, end = self._tokens, len(self._tokens)
        for n in self._sizes:
            if end < n:
                continue
            starts = self._starts[n].get(tuple(tokens[end - n :]))
            if starts:
                aligned, start = max((self._aligned(s, end - n), s) for s in starts)  # ties: the latest
                return tokens[start + n : start + n + limit], n + aligned
        return [], 0

    def _aligned(self, start: int, at: int) -> int:
        """How many tokens before `start` equal those before `at` (up to ALIGN_MAX)."""
        tokens, most = self._tokens, min(start, self.ALIGN_MAX)
        matched = 0
        while matched < most and tokens[start - 1 - matched] == tokens[at - 1 - matched]:
            matched += 1
        return matched

    def _sync(self, history: Sequence[int]) -> None:
        held = len(self._tokens)  # a generation's history only grows; anything else starts over
        if len(history) < held or list(history[:held]) != self._tokens:
            self._reset()
        for token in history[len(self._tokens) :]:
            self._tokens.append(token)
            end = len(self._tokens)
            for n in self._sizes:  # the n-grams ending just before `token` now have a follower
                start = end - 1 - n
                if start >= 0:
                    starts = self._starts[n].setdefault(tuple(self._tokens[start : end - 1]), [])
                    starts.append(start)
                    if len(starts) > self.CANDIDATES:
                        del starts[0]


@dataclass(frozen=True, slots=True)
class DraftState:
    """A draft model's caches and the tokens they hold: what a generation checkpoint keeps of
    it, so a resumed generation's drafts do not start by reading the whole history again."""

    tokens: tuple[int, ...]
    caches: list[LayerCache]


class DraftModel:
    """Greedy drafts from a smaller model with the same tokenizer, on caches of its own that
    follow the history (kept positions are reused; what a round rejected is trimmed). `state`:
    where a checkpoint left them (its tokens are reused where the history still starts with them).

    A layer-skip draft given its target's caches (`target`, holding all of the history but its
    last token whenever drafts are asked for) copies their first layers instead of feeding more
    than `SYNC_AFTER` tokens or starting over (recurrent state, a wrapped ring): the same KV,
    computed already (the first proposal of a prompt, the catch-up after a spell of plain steps
    and the rounds of recurrent drafts cost nothing then).

    `adapters`: what the drafts run under (the target's adapters where the draft is its base
    model, see `draft_adapters`; none otherwise: drafts are proposals, the target verifies them)."""

    SYNC_AFTER = 16

    def __init__(self, binding: MlxAutoregressiveBinding, state: DraftState | None = None,
                 target: list[LayerCache] | None = None, adapters: AdapterStack = AdapterStack()) -> None:
        self.binding = binding
        self.adapters = adapters
        self._caches: list[LayerCache] = self._tagged(state.caches) if state is not None else self._fresh()
        self._tokens: list[int] = list(state.tokens) if state is not None else []  # what the caches hold
        self._target = target
        # Copies of the caches holding the history before the last drafts were fed, kept where they
        # cannot be trimmed back (a wrapped sliding-window ring): the next proposal starts from them.
        self._base: tuple[int, list[LayerCache]] | None = None
        self.catch_up_s = 0.0  # seconds the last proposal spent reading a whole prompt first (not drafting)

    def snapshot(self, history: Sequence[int]) -> DraftState | None:
        """A frozen copy of the caches' part that `history` starts with (None: none of it, the
        rest cannot be cut off (a wrapped ring, recurrent state), or the caches are copied from
        the target's whenever needed)."""
        keep = common_prefix(self._tokens, history)
        if keep == 0 or self._target is not None:
            return None
        try:
            return DraftState(tuple(self._tokens[:keep]), frozen_copy(self._caches, keep))
        except CacheTrimError:
            return None

    def propose(self, history: Sequence[int], limit: int) -> list[int]:
        self.catch_up_s = 0.0
        if limit < 1 or not history:
            return []
        try:
            return self._propose(history, limit)
        except Exception:  # noqa: BLE001 - drafts only speed a generation up: a failing draft model must not fail it
            log.warning("the draft model failed; it starts over from the history", exc_info=True)
            self._caches, self._tokens, self._base = self._fresh(), [], None
            return []

    def _propose(self, history: Sequence[int], limit: int) -> list[int]:
        keep = min(common_prefix(self._tokens, history), len(history) - 1)
        stale = len(history) - keep > self.SYNC_AFTER or not (covered_tokens(self._caches) <= keep or all_trimmable(self._caches))
        if stale and self._target is not None and covered_tokens(self._target) == len(history) - 1:
            self._caches = self._tagged([cache.clone() for cache in self._target[: len(self._caches)]])
            self._tokens, self._base = list(history[:-1]), None
        else:
            self._rewind(keep)
        fresh = list(history[len(self._tokens) :])
        if len(fresh) > DEFAULT_PREFILL_CHUNK:  # a whole prompt (the first proposal, or after a reset)
            started = time.perf_counter()
            self.binding.prefill(fresh[:-1], self._caches)
            self.catch_up_s = time.perf_counter() - started
        elif len(fresh) > 1:  # what the last round accepted: one step, no buffer-cache release
            self.binding.feed(fresh[:-1], self._caches)
        logits = self.binding.decode(mx.array(fresh[-1:]), self._caches)
        self._tokens = list(history)
        self._base = None if all_trimmable(self._caches) else (len(history), [c.clone() for c in self._caches])
        drafts: list[int] = []
        for i in range(limit):
            token = _argmax(logits)
            drafts.append(token)
            if i + 1 < limit:
                logits = self.binding.decode(mx.array([token]), self._caches)
                self._tokens.append(token)
        return drafts

    def _rewind(self, keep: int) -> None:
        held = covered_tokens(self._caches)
        if held <= keep:
            return
        try:
            for cache in self._caches:
                cache.trim(held - keep)
        except CacheTrimError:  # a wrapped ring or recurrent state: from before the drafts, else start over
            base, self._base = self._base, None
            if base is not None and base[0] <= keep:
                self._caches, self._tokens = self._tagged(base[1]), self._tokens[: base[0]]
            else:
                self._caches, self._tokens = self._fresh(), []
            return
        self._tokens = self._tokens[:keep]


    def _fresh(self) -> list[LayerCache]:
        return self._tagged(self.binding.make_cache())

    def _tagged(self, caches: list[LayerCache]) -> list[LayerCache]:
        return self.binding.adapters.tag(caches, self.adapters) if self.adapters.adapters else caches


def draft_adapters(target: MlxAutoregressiveBinding, draft: MlxAutoregressiveBinding,
                   caches: Sequence[LayerCache]) -> AdapterStack:
    """The adapters a draft runs a sequence's drafts under: those of its `caches` on `target`, cut
    to the draft's layers, where the draft is the target's base model (a layer-skip draft of it,
    the target itself, or a binding of the same weights and kernels: the same config fingerprint)
    and they fit; else none."""
    stack = target.adapters.stack_of(caches)
    same_base = draft.prefix_of is target or draft is target or draft.config_fingerprint == target.config_fingerprint
    if not stack.adapters or not same_base:
        return AdapterStack()
    restricted = draft.adapters.restricted(stack)
    if restricted is None:
        log.info("draft model %s does not fit adapters %s: it drafts on its base model", draft.model_id, stack.ns)
        return AdapterStack()
    return restricted


def _argmax(logits: mx.array) -> int:
    value = mx.argmax(logits, axis=-1).item()
    assert isinstance(value, int)
    return value
