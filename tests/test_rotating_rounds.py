"""Sliding-window (rotating) caches: a position gets the same bits however it is fed (in a prompt
chunk, a single step or a speculative round, before or past the window, whatever came before),
because a full ring is attended oldest key first, as a chunk attends. So a round is a written
chunk, trimmed after (compiled too), every position gets bitwise the logits of single steps, the
caches keep the window single steps keep, and generations the tokens of not speculating."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import pytest

from mlxkv_inference import Generation, GenerationParams, SamplingParams
from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_inference.cache.ring_order import oldest_first
from mlxkv_inference.cache.rounds import Round, round_fits
from mlxkv_inference.kv_scheme import KvScheme
from mlxkv_inference.models.draft import layer_skip_draft
from mlxkv_inference.speculative.speculation import SpeculativeMode, SpeculativeParams
from tests.factories import count_fed_tokens, count_graph_forwards, make_prompt, make_tiny_binding

WINDOW = 16
SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.3, seed=3)}


def test_a_round_never_starts_with_room_in_the_ring_and_ends_past_it() -> None:
    cache = RotatingKVCache(WINDOW, keep=2)
    cache.update_and_fetch(mx.zeros((1, 1, 12, 4)), mx.zeros((1, 1, 12, 4)))
    assert round_fits([cache], 9, KvScheme(), full_rings=True) == WINDOW - 12 - 1
    cache.update_and_fetch(mx.zeros((1, 1, 8, 4)), mx.zeros((1, 1, 8, 4)))  # full
    assert round_fits([cache], 30, KvScheme(), full_rings=True) == WINDOW - 2  # one ring, less what it keeps
    assert round_fits([cache], 9, KvScheme(), full_rings=False) == 1  # the binding did not find it exact


def test_a_full_ring_is_read_from_its_oldest_cell_around_to_its_newest_after_what_it_keeps() -> None:
    assert oldest_first(13, 2, 16).tolist() == [0, 1, 13, 14, 15, *range(2, 13)]
    assert oldest_first(13, 2, 16, drop_oldest=True).tolist() == [0, 1, 14, 15, *range(2, 13)]
    assert oldest_first(0, 0, 4).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("compiled", [False, True], ids=["graph", "compiled"])
@pytest.mark.parametrize("native", [False, True], ids=["mlx", "native"])
def test_a_position_past_the_window_gets_the_same_bits_in_a_chunk_or_a_step_whatever_was_fed_before(
    native: bool, compiled: bool
) -> None:
    binding = make_tiny_binding("gemma3_text", seed=1, native=native, sliding_window=WINDOW)
    prompt = make_prompt(70, seed=3)

    def fed_in(chunks: list[int]) -> tuple[mx.array, list[Any]]:
        caches, at = binding.make_cache(), 0
        for n in chunks:  # a chunk, or single steps (compiled where asked, once the caches hold something)
            if n == 1 and compiled and at > 0:
                assert binding.decode_compiled(mx.array(prompt[at : at + 1]), caches) is not None
            else:
                binding.feed(prompt[at : at + n], caches)
            at += n
        last = binding.decode_compiled(mx.array(prompt[-1:]), caches) if compiled else binding.decode(mx.array(prompt[-1:]), caches)
        assert last is not None
        return last, caches

    reference, reference_caches = fed_in([69])
    for chunks in ([40] + [1] * 29, [20] * 3 + [9], [1] * 69, [30, 1, 1, 37], [17, 1, 20, 1, 30]):
        logits, caches = fed_in(chunks)
        assert mx.array_equal(logits, reference).item(), chunks
        for cache, other in zip(caches, reference_caches):
            if isinstance(cache, RotatingKVCache) and isinstance(other, RotatingKVCache):
                assert all(mx.array_equal(a, b).item() for a, b in zip(cache.window(), other.window()))


@pytest.mark.parametrize("compiled", [False, True], ids=["graph", "compiled"])
@pytest.mark.parametrize("native", [False, True], ids=["mlx", "native"])
@pytest.mark.parametrize(("prompt_tokens", "single_step", "rows"), [
    (16, True, 4), (20, False, 5), (23, True, 6), (40, True, 16), (33, False, 9),
])
def test_a_round_over_a_full_ring_gives_each_position_the_logits_and_ring_of_single_steps(
    native: bool, compiled: bool, prompt_tokens: int, single_step: bool, rows: int
) -> None:
    binding = make_tiny_binding("gemma3_text", seed=1, native=native, sliding_window=WINDOW)
    assert binding.verifies_full_rings
    caches = binding.make_cache()
    binding.prefill(make_prompt(prompt_tokens, seed=2), caches)  # no single step: the buffer is still a chunk's
    if single_step:
        binding.decode(mx.array([3]), caches)
    fed = make_prompt(rows, seed=5)
    for kept in (1, rows // 2 + 1, rows):
        trial, alone = [c.clone() for c in caches], [c.clone() for c in caches]
        single = [binding.decode(mx.array([t]), alone)[0] for t in fed[:kept]]
        open_round = Round(trial, rows)
        logits = binding.decode_compiled(mx.array(fed), trial) if compiled else binding.decode_positions(mx.array(fed), trial)
        assert logits is not None
        together = logits
        open_round.keep(kept, fed, binding.feed)
        assert all(mx.array_equal(together[i], single[i]).item() for i in range(kept))
        for cache, reference in zip(trial, alone):
            assert cache.offset == reference.offset
            if isinstance(cache, RotatingKVCache) and isinstance(reference, RotatingKVCache):
                assert all(mx.array_equal(a, b).item() for a, b in zip(cache.window(), reference.window()))


@pytest.mark.parametrize("native", [False, True], ids=["mlx", "native"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("mode", ["prompt_lookup", "draft"])
def test_speculation_on_sliding_window_caches_gives_the_tokens_of_not_speculating(
    mode: SpeculativeMode, sampling: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    binding = make_tiny_binding("gemma3_text", seed=1, native=native, sliding_window=WINDOW)
    base = make_prompt(3, seed=3)
    prompt = (base * 3)[:8]  # repeats itself (prompt lookup drafts from it); answers run past the window
    params = GenerationParams(max_tokens=30, ignore_eos=True, sampling=SAMPLINGS[sampling])
    plain = Generation(binding, prompt, params).run()
    rounds: list[tuple[int, int]] = []  # (a sliding window's tokens before the round, positions)
    begin = Round.__init__

    def recorded(self: Round, caches: list[Any], fed: int, replay: bool = False) -> None:
        rounds.extend((c.offset, fed) for c in caches[:1] if isinstance(c, RotatingKVCache))
        begin(self, caches, fed, replay)

    monkeypatch.setattr(Round, "__init__", recorded)
    draft = layer_skip_draft(binding, 2) if mode == "draft" else None
    spec = SpeculativeParams(mode=mode, num_draft_tokens=5, adaptive=False)
    fast = Generation(binding, prompt, replace(params, speculative=spec), draft=draft).run()
    assert fast.token_ids == plain.token_ids
    assert fast.accepted_tokens > 0 if mode == "draft" else fast.draft_tokens > 0  # random weights copy little
    assert max(fed for offset, fed in rounds if offset >= WINDOW) > 1  # rounds ran over full rings
    assert all(offset + fed < WINDOW for offset, fed in rounds if offset < WINDOW)  # none ran from room to past it


@pytest.mark.parametrize("native", [False, True], ids=["mlx", "native"])
@pytest.mark.parametrize(("prompt_tokens", "rows"), [(2, 9), (5, 4), (9, 5), (300, 7)])
def test_a_compiled_round_gives_each_position_the_logits_of_single_compiled_steps(native: bool, prompt_tokens: int,
                                                                                  rows: int) -> None:
    window = 512 if prompt_tokens > WINDOW else WINDOW  # 300: the buffer grows (256-token steps) inside the round
    binding = make_tiny_binding("gemma3_text", seed=1, native=native, sliding_window=window)
    assert binding.compiles_positions
    caches = binding.make_cache()
    binding.prefill(make_prompt(prompt_tokens, seed=2), caches)
    binding.decode_compiled(mx.array([3]), caches)
    assert round_fits(caches, rows, binding.kv_scheme) == rows
    alone = [c.clone() for c in caches]
    fed = make_prompt(rows, seed=5)
    Round(caches, rows)
    together = binding.decode_compiled(mx.array(fed), caches)
    assert together is not None
    for i, token in enumerate(fed):
        single = binding.decode_compiled(mx.array([token]), alone)
        assert single is not None and mx.array_equal(together[i], single[0]).item()
    for cache, reference in zip(caches, alone):
        assert cache.offset == reference.offset
        if isinstance(cache, PlainKVCache | RotatingKVCache) and isinstance(reference, PlainKVCache | RotatingKVCache):
            assert cache.keys is not None and reference.keys is not None
            n = cache.offset
            assert mx.array_equal(cache.keys[..., :n, :], reference.keys[..., :n, :]).item()


def test_rounds_on_sliding_window_caches_run_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    binding = make_tiny_binding("gemma3_text", seed=1, native=True, sliding_window=WINDOW)  # rings full from the prompt on
    prompt = (make_prompt(7, seed=3) * 6)[:40]
    params = GenerationParams(max_tokens=60, ignore_eos=True)
    plain = Generation(binding, prompt, params).run()
    graph_rounds = count_graph_forwards(binding, "decode_positions", monkeypatch)
    spec = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=5, adaptive=False)
    fast = Generation(binding, prompt, replace(params, speculative=spec)).run()
    assert fast.token_ids == plain.token_ids and fast.draft_tokens > 0
    assert graph_rounds == []


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


def test_where_the_full_ring_probe_fails_rounds_stop_at_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxkv_inference import binding_probes

    monkeypatch.setattr(binding_probes, "full_rings_agree", lambda binding: False)
    binding = make_tiny_binding("gemma3_text", seed=1, sliding_window=WINDOW)
    assert binding.verifies_positions() and not binding.verifies_full_rings
    prompt = (make_prompt(3, seed=3) * 3)[:8]
    params = GenerationParams(max_tokens=30, ignore_eos=True)
    plain = Generation(binding, prompt, params).run()
    rounds: list[tuple[int, int]] = []
    begin = Round.__init__

    def recorded(self: Round, caches: list[Any], fed: int, replay: bool = False) -> None:
        rounds.extend((c.offset, fed) for c in caches[:1] if isinstance(c, RotatingKVCache))
        begin(self, caches, fed, replay)

    monkeypatch.setattr(Round, "__init__", recorded)
    spec = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=5, adaptive=False)
    fast = Generation(binding, prompt, replace(params, speculative=spec)).run()
    assert fast.token_ids == plain.token_ids and fast.draft_tokens > 0
    assert all(offset + fed < WINDOW for offset, fed in rounds)
