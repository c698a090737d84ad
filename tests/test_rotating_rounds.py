"""Speculative rounds over sliding-window (rotating) caches past the window: each position of a
round attends exactly the keys, in the order, of a single decode step there, and the kept
positions leave the cache as single steps would; generations give the tokens of not speculating."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import pytest

from mlxkv_inference import Generation, GenerationParams, SamplingParams
from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_inference.cache.ring_rounds import RingState, round_layout
from mlxkv_inference.models.draft import layer_skip_draft
from mlxkv_inference.speculative.speculation import SpeculativeMode, SpeculativeParams
from tests.factories import count_fed_tokens, make_prompt, make_tiny_binding

WINDOW = 16
SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.3, seed=3)}


def test_round_layout_puts_each_new_key_before_the_slot_it_overwrites() -> None:
    # The module's example: window 4 holding 8 9 6 7, next write at slot 2, a round of 10 11 12.
    layout = round_layout(RingState(length=4, offset=10, index=2, keep=0, max_size=4, step=256), 3)
    assert layout.gather == (0, 6, 1, 4, 3, 5)  # 8 12 9 10 7 11 (4 + j: the round's j-th key)
    assert layout.visible == ((True, False, True, True, True, False),
                              (True, False, True, True, False, True),
                              (False, True, True, True, False, True))


def filled(max_size: int, keep: int, chunks: list[int]) -> RotatingKVCache:
    """A cache fed `chunks` (multi-token writes, then single steps for chunks of 1) whose key
    and value at each position are that position's number."""
    cache = RotatingKVCache(max_size, keep)
    at = 0
    for n in chunks:
        cache.update_and_fetch(*numbered(at, n))
        at += n
    return cache


def numbered(start: int, n: int) -> tuple[mx.array, mx.array]:
    keys = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1)
    return keys, keys + 0.5


@pytest.mark.parametrize(("keep", "chunks", "rows"), [
    (0, [20], 5),  # right after a prompt chunk longer than the window
    (0, [20, 1, 1, 1], 7),  # mid-ring
    (0, [9, 1, 1, 1, 1], 6),  # the round fills the window and wraps
    (0, [5], 3),  # far from the window: the causal round of before
    (2, [13, 1, 1, 1, 1, 1, 1, 1, 1, 1], 8),  # mlx-lm's `keep`: first tokens never evicted
    (0, [30, 1], 16),  # a round as long as the ring
])
def test_round_positions_see_what_single_steps_see_and_keep_their_state(keep: int, chunks: list[int], rows: int) -> None:
    start = sum(chunks)
    stepped = filled(16, keep, chunks)
    singles = []
    for j in range(rows):
        keys, values = stepped.update_and_fetch(*numbered(start + j, 1))
        singles.append((keys.reshape(-1).tolist(), values.reshape(-1).tolist()))
    for kept in (1, rows // 2 + 1, rows):
        cache = filled(16, keep, chunks)
        cache.begin_round(rows)
        mask = cache.make_mask(rows, window_size=16)
        keys, values = cache.update_and_fetch(*numbered(start, rows))
        for j in range(rows):
            seen = [i for i in range(keys.shape[2]) if mask[j, i].item()]
            assert [keys.reshape(-1)[i].item() for i in seen] == singles[j][0]
            assert [values.reshape(-1)[i].item() for i in seen] == singles[j][1]
        cache.end_round(kept)
        reference = filled(16, keep, chunks + [1] * kept)
        assert (cache.offset, cache.ring_index) == (reference.offset, reference.ring_index)
        assert cache.keys is not None and reference.keys is not None
        assert cache.keys.reshape(-1).tolist() == reference.keys.reshape(-1).tolist()


@pytest.mark.parametrize("native", [False, True], ids=["mlx", "native"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("mode", ["prompt_lookup", "draft"])
def test_speculation_past_the_window_gives_the_tokens_of_not_speculating(
    mode: SpeculativeMode, sampling: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    binding = make_tiny_binding("gemma3_text", seed=1, native=native, sliding_window=WINDOW)
    base = make_prompt(7, seed=3)
    prompt = (base * 6)[:40]  # repeats itself (prompt lookup drafts from it), 2.5 windows long
    params = GenerationParams(max_tokens=60, ignore_eos=True, sampling=SAMPLINGS[sampling])
    plain = Generation(binding, prompt, params).run()
    wrapped_rounds: list[int] = []
    begin = RotatingKVCache.begin_round

    def recorded(cache: RotatingKVCache, rows: int) -> None:
        if cache.offset >= WINDOW:
            wrapped_rounds.append(rows)
        begin(cache, rows)

    monkeypatch.setattr(RotatingKVCache, "begin_round", recorded)
    draft = layer_skip_draft(binding, 2) if mode == "draft" else None
    spec = SpeculativeParams(mode=mode, num_draft_tokens=5, adaptive=False)
    fast = Generation(binding, prompt, replace(params, speculative=spec), draft=draft).run()
    assert fast.token_ids == plain.token_ids
    assert fast.accepted_tokens > 0 if mode == "draft" else fast.draft_tokens > 0  # random weights copy little
    assert wrapped_rounds and max(wrapped_rounds) > 1  # rounds of several positions ran with the rings wrapped


def test_a_sliding_window_draft_model_goes_on_from_before_its_drafts_past_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    binding = make_tiny_binding("gemma3_text", seed=1, sliding_window=WINDOW)
    draft = make_tiny_binding("gemma3_text", seed=2, sliding_window=WINDOW, num_hidden_layers=2)  # its drafts miss
    fed = count_fed_tokens(draft, monkeypatch)
    prompt = make_prompt(40, seed=4)
    params = GenerationParams(max_tokens=40, ignore_eos=True)
    plain = Generation(binding, prompt, params).run()
    spec = SpeculativeParams(mode="draft", num_draft_tokens=4, adaptive=False)
    fast = Generation(binding, prompt, replace(params, speculative=spec), draft=draft).run()
    assert fast.token_ids == plain.token_ids
    assert fast.draft_tokens > 30
    assert fed == [len(prompt) - 1]  # the history read once: each round's rejected drafts dropped, not the history re-read


def test_a_round_as_long_as_the_ring_is_the_most_a_rotating_cache_verifies() -> None:
    cache = filled(8, 2, [12])
    with pytest.raises(ValueError, match="a round of 7 positions does not fit a 8-token window keeping 2"):
        cache.begin_round(7)
    cache.begin_round(6)
    any_cache: Any = cache
    assert any_cache._round is not None
