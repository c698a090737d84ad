"""Speculative decoding gives exactly the tokens of not speculating: per cache kind, per proposer,
greedy and seeded, alone and in a batch; and the pieces (prompt lookup, rounds, adaptivity)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest

from mlxkv_inference import Generation, GenerationParams, KvScheme, MlxAutoregressiveBinding, SamplingParams
from mlxkv_inference.cache.reuse import covered_tokens
from mlxkv_inference.generation.results import GenerationResult
from mlxkv_inference.speculative.proposers import PromptLookup
from mlxkv_inference.scheduler.batch import BatchScheduler
from mlxkv_inference.speculative.speculation import SpeculativeMode, SpeculativeParams
from mlxkv_inference.step_costs import StepCosts
from mlxkv_inference.cache.rounds import round_fits
from mlxkv_inference.speculative.speculator import COPY_RUN, Speculator
from mlxkv_inference.models.draft import layer_skip_draft
from tests.factories import count_fed_tokens, make_prompt, make_tiny_binding

# kind -> (model overrides, kv scheme, draft layers). Rotating: a window the rounds run into;
# quantized: rounds straddle the quantization start; recurrent: a hybrid with linear attention.
MODELS: dict[str, tuple[str, dict[str, Any], KvScheme, int]] = {
    "plain": ("llama", {}, KvScheme(), 1),
    "plain-qwen3": ("qwen3", {}, KvScheme(), 1),
    "rotating": ("gemma3_text", {"sliding_window": 48}, KvScheme(), 2),
    "full-rings": ("gemma3_text", {"sliding_window": 16}, KvScheme(), 2),  # prompts fill the rings: rounds over them
    "quantized": ("llama", {"head_dim": 64}, KvScheme(bits=8, group_size=32, quantized_start=40), 1),
    "recurrent": ("qwen3_next", {}, KvScheme(), 2),
}
SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.9, seed=11)}


def _binding(name: str) -> MlxAutoregressiveBinding:
    kind, overrides, scheme, _ = MODELS[name]
    return make_tiny_binding(kind, kv_scheme=scheme, **overrides)


def repetitive_prompt(length: int) -> list[int]:
    """A prompt that repeats itself (so prompt lookup finds n-grams to draft from)."""
    base = make_prompt(9, seed=3)
    return (base * (length // len(base) + 1))[:length]


def run(binding: MlxAutoregressiveBinding, prompt: list[int], sampling: SamplingParams, spec: SpeculativeParams,
        draft: MlxAutoregressiveBinding | None = None, max_tokens: int = 40) -> GenerationResult:
    params = GenerationParams(max_tokens=max_tokens, sampling=sampling, ignore_eos=True, speculative=spec)
    return Generation(binding, prompt, params, draft=draft).run()


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("mode", ["prompt_lookup", "draft"])
@pytest.mark.parametrize("name", MODELS)
def test_speculation_gives_the_tokens_of_not_speculating(name: str, mode: SpeculativeMode, sampling: str) -> None:
    binding = _binding(name)
    draft = layer_skip_draft(binding, MODELS[name][3]) if mode == "draft" else None
    prompt = repetitive_prompt(30)
    plain = run(binding, prompt, SAMPLINGS[sampling], SpeculativeParams())
    spec = SpeculativeParams(mode=mode, num_draft_tokens=4, adaptive=False)
    fast = run(binding, prompt, SAMPLINGS[sampling], spec, draft)
    assert fast.token_ids == plain.token_ids
    assert fast.draft_tokens > 0  # rounds really ran
    assert binding.verifies_positions()


def test_rounds_accept_and_reject_so_both_paths_run() -> None:
    """Across the matrix above some drafts are accepted and some rejected; pin it on one case
    each, so the exactness test above is not passing on rounds that all accept or all reject."""
    for name in ("plain", "recurrent"):
        binding = _binding(name)
        draft = layer_skip_draft(binding, MODELS[name][3])
        result = run(binding, repetitive_prompt(30), SAMPLINGS["greedy"],
                     SpeculativeParams(mode="draft", num_draft_tokens=4, adaptive=False), draft)
        assert 0 < result.accepted_tokens < result.draft_tokens


def test_logprobs_of_a_speculative_run_are_bitwise_those_of_a_plain_run() -> None:
    binding = _binding("plain")
    prompt = repetitive_prompt(30)

    def steps(spec: SpeculativeParams) -> list[tuple[int, mx.array]]:
        params = GenerationParams(max_tokens=30, ignore_eos=True, speculative=spec)
        return [(d.step.token, d.step.logprobs) for d in Generation(binding, prompt, params) if d.step is not None]

    plain = steps(SpeculativeParams())
    fast = steps(SpeculativeParams(mode="prompt_lookup", num_draft_tokens=5, adaptive=False))
    assert [t for t, _ in fast] == [t for t, _ in plain]
    assert all(bool(mx.array_equal(a, b).item()) for (_, a), (_, b) in zip(fast, plain))


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("name", ["plain", "quantized", "recurrent", "full-rings"])
def test_speculating_rows_in_a_batch_keep_every_rows_tokens(name: str, sampling: str) -> None:
    binding = _binding(name)
    draft = layer_skip_draft(binding, MODELS[name][3])
    prompts = [repetitive_prompt(30), make_prompt(17, seed=5), repetitive_prompt(22), make_prompt(12, seed=8)]
    specs = [SpeculativeParams(mode="prompt_lookup", num_draft_tokens=5, adaptive=False),
             SpeculativeParams(),
             SpeculativeParams(mode="draft", num_draft_tokens=3, adaptive=False),
             SpeculativeParams(mode="prompt_lookup", num_draft_tokens=2, adaptive=False)]
    sampling_params = SAMPLINGS[sampling]
    alone = [run(binding, p, sampling_params, SpeculativeParams(), max_tokens=24).token_ids for p in prompts]

    scheduler = BatchScheduler(binding, max_batch=4)
    generations = [Generation(binding, p, GenerationParams(max_tokens=24, sampling=sampling_params, ignore_eos=True,
                                                           speculative=s), draft=draft)
                   for p, s in zip(prompts, specs)]
    for generation in generations:
        scheduler.add(generation)
    while scheduler.running:
        scheduler.step()
    for generation, expected in zip(generations, alone):
        assert generation.result is not None
        assert generation.result.token_ids == expected
    assert sum(g.result.draft_tokens for g in generations if g.result is not None) > 0
    if name != "recurrent":  # the hybrid graph runs a graph per row; the others ran stacked rows
        assert scheduler.batched_steps > 0


def test_a_round_stops_where_the_generation_does() -> None:
    """max_tokens, EOS and stop strings may fall inside a round: the result and the caches end
    exactly where a plain run's do."""
    binding = _binding("plain")
    prompt = repetitive_prompt(30)
    for max_tokens in (1, 2, 7):
        plain = Generation(binding, prompt, GenerationParams(max_tokens=max_tokens, ignore_eos=True))
        fast = Generation(binding, prompt, GenerationParams(max_tokens=max_tokens, ignore_eos=True, speculative=SpeculativeParams(
            mode="prompt_lookup", num_draft_tokens=6, adaptive=False)))
        assert fast.run().token_ids == plain.run().token_ids
        assert fast.fed_tokens() == plain.fed_tokens()
        assert [c.offset for c in fast.caches] == [c.offset for c in plain.caches]


def test_checkpoints_taken_during_speculation_resume_exactly() -> None:
    from mlxkv_inference.generation.results import CheckpointState, ResumePoint

    binding = _binding("plain")
    prompt = repetitive_prompt(30)
    spec = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=6, adaptive=False)
    checkpoints: list[CheckpointState] = []
    params = GenerationParams(max_tokens=40, ignore_eos=True, speculative=spec)
    full = Generation(binding, prompt, params, checkpoint_every=8, on_checkpoint=checkpoints.append).run()
    assert full.draft_tokens > 0
    assert [len(c.generated) for c in checkpoints] == [8, 16, 24, 32]
    for state in checkpoints:
        resumed = Generation(binding, prompt, params, state.caches,
                             resume=ResumePoint(state.generated, state.pending)).run()
        assert resumed.token_ids == full.token_ids


def test_draft_checkpoints_keep_the_draft_caches_and_resume_without_reading_the_history_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxkv_inference.cache.reuse import frozen_copy
    from mlxkv_inference.generation.results import CheckpointState, ResumePoint

    binding = _binding("plain")
    # The target's weights as a model of its own (a layer-skip draft copies the target's KV): its
    # greedy drafts are the target's tokens, so caches restored wrong would show in the acceptance.
    draft = make_tiny_binding("llama")
    fed = count_fed_tokens(draft, monkeypatch)
    prompt = repetitive_prompt(60)
    params = GenerationParams(max_tokens=40, ignore_eos=True, speculative=SpeculativeParams(
        mode="draft", num_draft_tokens=3, adaptive=False))
    checkpoints: list[CheckpointState] = []
    full = Generation(binding, prompt, params, checkpoint_every=8, on_checkpoint=checkpoints.append, draft=draft).run()
    assert full.draft_tokens > 0 and len(checkpoints) == 4
    for state in checkpoints:
        assert state.draft is not None
        history = (*prompt, *state.generated)
        # a prefix of what the target's caches hold, at most the pending token and a round behind them
        assert state.draft.tokens == history[: len(state.draft.tokens)] and len(state.draft.tokens) >= len(history) - 4
        assert [c.offset for c in state.draft.caches] == [len(state.draft.tokens)] * len(state.draft.caches)
        counts = []
        for draft_state, reread in ((state.draft, False), (None, True)):
            fed.clear()
            caches = frozen_copy(state.caches, len(history))
            resumed = Generation(binding, prompt, params, caches, draft=draft,
                                 resume=ResumePoint(state.generated, state.pending, draft_state)).run()
            assert resumed.token_ids == full.token_ids
            assert (max(fed) >= len(history) - 1) == reread  # without the state the draft reads the history first
            counts.append((resumed.draft_tokens, resumed.accepted_tokens))
        assert counts[0] == counts[1] and counts[0][1] > 0  # the restored caches draft what re-reading drafts


@pytest.mark.parametrize("native", [False, True], ids=["mlx", "native"])
def test_rounds_on_plain_caches_run_the_compiled_step_and_keep_their_tokens(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    binding = make_tiny_binding("llama", seed=4, native=native)
    assert binding.compiles_positions
    uncompiled: list[int] = []  # rounds run through the ordinary graph (the compiled step's fallback)
    graph = binding.decode_positions

    def counted(tokens: mx.array, caches: list[Any]) -> mx.array:
        uncompiled.append(tokens.size)
        return graph(tokens, caches)

    monkeypatch.setattr(binding, "decode_positions", counted)
    prompt = repetitive_prompt(30)
    spec = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=4, adaptive=False)
    for sampling in SAMPLINGS.values():
        plain = run(binding, prompt, sampling, SpeculativeParams())
        fast = run(binding, prompt, sampling, spec)
        assert fast.token_ids == plain.token_ids and fast.draft_tokens > 0 and uncompiled == []
    params = GenerationParams(max_tokens=40, sampling=SAMPLINGS["seeded"], ignore_eos=True, compiled_decode=False, speculative=spec)
    assert Generation(binding, prompt, params).run().token_ids == plain.token_ids  # the seeded plain run's
    assert uncompiled  # ... through the ordinary graph


def test_a_compiled_round_that_fails_leaves_single_steps_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    binding = make_tiny_binding("llama", seed=4)
    compiled, graph = binding.decode_compiled, binding.decode
    single_graph_steps: list[int] = []

    def flaky(tokens: mx.array, caches: list[Any]) -> mx.array | None:
        if tokens.size > 1:
            raise RuntimeError("this trace fails")
        return compiled(tokens, caches)

    def counted(tokens: mx.array, caches: list[Any]) -> mx.array:
        single_graph_steps.append(tokens.size)
        return graph(tokens, caches)

    monkeypatch.setattr(binding, "decode_compiled", flaky)
    monkeypatch.setattr(binding, "decode", counted)
    prompt = repetitive_prompt(30)
    fast = run(binding, prompt, SAMPLINGS["greedy"], SpeculativeParams(mode="prompt_lookup", num_draft_tokens=4, adaptive=False))
    assert fast.token_ids == run(binding, prompt, SAMPLINGS["greedy"], SpeculativeParams()).token_ids and fast.draft_tokens > 0
    assert single_graph_steps == []  # rounds fell back to the graph; single steps stayed compiled


@pytest.mark.parametrize("name", ["plain", "recurrent"])
def test_a_layer_skip_draft_copies_the_targets_first_layers_instead_of_reading_the_prompt(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxkv_inference.speculative.proposers import DraftModel

    binding = _binding(name)
    draft = layer_skip_draft(binding, MODELS[name][3])
    prompt = repetitive_prompt(60)
    caches = binding.make_cache()
    binding.prefill(prompt[:-1], caches)  # what the target holds when drafts are asked for
    fed = count_fed_tokens(draft, monkeypatch)
    copied = DraftModel(draft, target=caches).propose(prompt, 4)
    assert fed == []  # only the pending token, by a one-token decode step
    assert copied == DraftModel(draft).propose(prompt, 4) and fed == [len(prompt) - 1]  # the same KV as reading the prompt
    assert covered_tokens(caches) == len(prompt) - 1  # the target's caches are left as they were

    spec = SpeculativeParams(mode="draft", num_draft_tokens=4, adaptive=False)
    fed.clear()
    result = run(binding, prompt, SAMPLINGS["greedy"], spec, draft)
    assert result.token_ids == run(binding, prompt, SAMPLINGS["greedy"], SpeculativeParams()).token_ids
    assert result.draft_tokens > 0 and all(n <= DraftModel.SYNC_AFTER for n in fed)


def test_recurrent_rounds_roll_back_through_the_recurrent_layers_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxkv_inference.cache.recurrent import RecurrentCache
    from mlxkv_inference.cache.rounds import Round

    binding = _binding("recurrent")
    assert binding.replays_recurrence
    caches = binding.make_cache()
    binding.prefill(make_prompt(20), caches)
    fed = make_prompt(6, seed=9)
    for n in range(1, len(fed)):  # every kept length: the replayed states are the refed ones, bit for bit
        states = []
        for replay in (True, False):
            trial = [c.clone() for c in caches]
            current = Round(trial, len(fed), replay)
            binding.decode_positions(mx.array(fed), trial)
            current.keep(n, fed, binding.feed)
            assert [c.offset for c in trial] == [20 + n] * len(trial)
            states.append([s for c in trial if isinstance(c, RecurrentCache) for s in c.state])
        assert all(mx.array_equal(a, b).item() for a, b in zip(*states) if a is not None and b is not None)

    prompt = repetitive_prompt(30)
    draft = layer_skip_draft(binding, MODELS["recurrent"][3])
    spec = SpeculativeParams(mode="draft", num_draft_tokens=4, adaptive=False)
    plain = run(binding, prompt, SAMPLINGS["greedy"], SpeculativeParams())
    refed = count_fed_tokens(binding, monkeypatch)
    fast = run(binding, prompt, SAMPLINGS["greedy"], spec, draft)
    assert fast.token_ids == plain.token_ids and 0 < fast.accepted_tokens < fast.draft_tokens
    assert sum(refed) <= len(prompt)  # the prompt's prefill; no rolled-back round fed the model again
    monkeypatch.setattr(binding, "_replays", False)
    refed.clear()
    assert run(binding, prompt, SAMPLINGS["greedy"], spec, draft).token_ids == plain.token_ids
    assert sum(refed) > len(prompt)  # without the replay, rolled-back rounds feed the whole model


def test_prompt_lookup_drafts_what_followed_the_longest_latest_match() -> None:
    lookup = PromptLookup(ngram_min=1, ngram_max=3)
    history = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    assert lookup.propose(history, 3) == [4, 9, 2]  # "1 2 3" (the longest match) followed by 4 9 2
    assert lookup.propose([1, 2, 3, 4, 9, 2, 3, 5, 7, 8, 2, 3], 2) == [5, 7]  # the latest "2 3" wins
    assert lookup.propose([5, 6, 7], 4) == []
    assert lookup.propose([5, 6, 7, 5], 4) == [6, 7, 5]


def test_prompt_lookup_copies_from_the_occurrence_aligned_furthest_back() -> None:
    lookup = PromptLookup(ngram_min=1, ngram_max=2)
    # "2 3" occurs twice; before the earlier one, as before the history's end, come 8 1
    history = [8, 1, 2, 3, 4, 9, 6, 1, 2, 3, 5, 7, 8, 1, 2, 3]
    assert lookup.propose(history, 2) == [4, 9]  # the latest occurrence would draft 5 7
    # only the latest CANDIDATES occurrences are weighed: push the aligned one out
    crowded = [8, 1, 2, 3, 4] + [6, 2, 3, 5] * PromptLookup.CANDIDATES + [8, 1, 2, 3]
    assert PromptLookup(ngram_min=1, ngram_max=2).propose(crowded, 2) == [5, 8]  # the latest


def test_prompt_lookup_follows_a_growing_history_and_starts_over_on_another() -> None:
    lookup = PromptLookup(ngram_min=2, ngram_max=2)
    history = [4, 5, 6, 4]
    assert lookup.propose(history, 2) == []  # one token of overlap is below ngram_min
    history.append(5)
    assert lookup.propose(history, 2) == [6, 4]
    assert lookup.propose([9, 9, 9], 2) == [9]


def test_round_fits_keeps_rounds_out_of_a_full_window_and_the_quantization_start() -> None:
    rotating = make_tiny_binding("gemma3_text", sliding_window=16)
    caches = rotating.make_cache()
    rotating.prefill(make_prompt(12), caches)
    assert round_fits(caches, 8, rotating.kv_scheme) == 3  # positions 12..14: the window stays short of full
    quantized = _binding("quantized")
    caches = quantized.make_cache()
    quantized.prefill(make_prompt(36), caches)
    assert round_fits(caches, 8, quantized.kv_scheme) == 3  # positions 36..38 stay below 40


def test_adaptive_length_turns_speculation_off_where_drafts_miss_and_back_on() -> None:
    costs = StepCosts()
    costs.record(1, 1.0)
    for rows in range(2, 8):
        costs.record(rows, 1.0 + 0.1 * (rows - 1))
    params = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=6)
    speculator = Speculator(params, PromptLookup(params.ngram_min, params.ngram_max), costs)
    history = [1, 2, 3, 1, 2, 3, 1, 2]
    assert speculator.drafts(history, 6) != []
    for _ in range(20):  # every draft misses
        drafts = speculator.drafts(history, 6)
        speculator.observe(drafts, [99])
    assert speculator.drafts(history, 6) == []
    for _ in range(30):  # the (free) shadow guesses start matching
        speculator.drafts(history, 6)
        speculator.observe([], [3])
    assert speculator.drafts(history, 6) != []


def test_prompt_lookup_drafts_go_by_how_far_their_match_runs_back_until_their_rounds_say_otherwise() -> None:
    costs = StepCosts()
    for rows in range(1, 8):
        costs.record(rows, 1.0 + 0.1 * (rows - 1))
    params = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=6)
    text = list(range(100, 140))
    five = text + [7] + text[:5]  # the history's end matches 5 tokens back
    two = text + [7, 3] + text[10:12]  # 2 tokens back
    speculator = Speculator(params, PromptLookup(params.ngram_min, params.ngram_max), costs)
    # the rule of succession: 5 of 6 for 4-7 matched tokens, 3 of 4 for 2-3
    longer, shorter = len(speculator.drafts(five, 6)), len(speculator.drafts(two, 6))
    assert longer > shorter > 1
    for _ in range(10):  # the long match's drafts keep missing
        speculator.observe(speculator.drafts(five, 6), [99])
    assert speculator.drafts(five, 6) == []
    assert len(speculator.drafts(two, 6)) == shorter  # another length's rate is its own


def test_a_copy_in_progress_drafts_the_limit_alone_but_not_where_it_slows_a_batch_more() -> None:
    costs = StepCosts()
    for rows, seconds in {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 5: 1.8, 8: 2.4, 9: 3.6}.items():
        costs.record(rows, seconds)
    params = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=4)
    text = list(range(100, 140))
    copying = text + [7] + text[:COPY_RUN]  # the history's last COPY_RUN tokens copy the start of `text`
    short = text + [7, 3] + text[COPY_RUN - 2 : COPY_RUN]  # the same 2-gram, matched 2 tokens back
    # the short match's drafts start at the rule of succession for 2 matched tokens, 3 in 4: two drafts
    for history, want in ((copying, 4), (short, 2)):
        speculator = Speculator(params, PromptLookup(params.ngram_min, params.ngram_max), costs)
        assert len(speculator.drafts(history, 4)) == want
    assert Speculator(params, PromptLookup(1, 8), costs).drafts(copying, 4) == text[COPY_RUN : COPY_RUN + 4]
    # eight generations' rows, where a ninth row costs half a step: even a copy's drafts lose there
    assert Speculator(params, PromptLookup(1, 8), costs).drafts(copying, 4, batch=8, sequences=8) == []
    # two generations: a copy drafts where the step is not pipelined anyway, and where it would be,
    # drafts only as `plans_drafts` said before the history was known (none, at the prior rate)
    speculator = Speculator(params, PromptLookup(1, 8), costs)
    assert len(speculator.drafts(copying, 4, batch=2, sequences=2)) == 4
    assert not speculator.plans_drafts(4, 2, 2, pipelining=True)
    assert speculator.drafts(copying, 4, batch=2, sequences=2, pipelining=True) == []


def test_a_generation_drafts_in_a_step_that_would_be_pipelined_only_where_that_pays_too() -> None:
    """One generation of two drafting makes the shared step unpipelined for both: at a gain that
    pays for the draft row but not for the pipelining lost, it drafts only where the step is not
    pipelined anyway."""
    costs = StepCosts()
    costs.record(2, 1.0)
    costs.record(3, 1.25)  # one draft next to the other generation's row: 1.25 steps
    costs.record(4, 100.0)  # no longer rounds
    params = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=1)
    speculator = Speculator(params, PromptLookup(params.ngram_min, params.ngram_max), costs)
    history = [1, 2, 3, 1, 2, 3, 1, 2]
    for _ in range(40):  # every draft accepted: acceptance ~0.99, ~2 tokens a round for 1.25 steps
        speculator.observe(speculator.drafts(history, 1, 2, 2), [3, 1])
    assert speculator.drafts(history, 1, 2, 2) == [3]
    assert speculator.plans_drafts(1, 2, 2)
    assert not speculator.plans_drafts(1, 2, 2, pipelining=True)
    assert speculator.drafts(history, 1, 2, 2, pipelining=True) == []


def native_tiny() -> MlxAutoregressiveBinding:
    """The server's path on a tiny model: 4-bit weights through mlxkv's native kernels."""
    return make_tiny_binding("llama", seed=4, native=True)


@pytest.mark.parametrize("case", ["penalties", "regex"])
def test_speculation_keeps_penalties_and_grammars_exact_on_the_native_kernel(case: str) -> None:
    from dataclasses import replace

    from mlxkv_inference import Grammar

    binding = native_tiny()
    sampling = SamplingParams(temperature=0.8, seed=9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    params = GenerationParams(max_tokens=40, sampling=sampling, ignore_eos=case != "regex")
    if case == "regex":
        params = replace(params, grammar=Grammar("regex", r"([a-c]{2}-[0-9]{2} ){6}"))
    prompt = repetitive_prompt(30)
    plain = Generation(binding, prompt, params).run()
    fast = Generation(binding, prompt, replace(params, speculative=SpeculativeParams(
        mode="prompt_lookup", num_draft_tokens=4, adaptive=False))).run()
    assert fast.token_ids == plain.token_ids
    assert fast.draft_tokens > 0


def test_step_costs_interpolate_between_measured_sizes_and_extrapolate_past_them() -> None:
    costs = StepCosts()
    costs.record(1, 0.020)
    assert costs.seconds(1) == 0.020 and costs.seconds(4) is None  # one size known: no line yet
    assert costs.relative(4) == pytest.approx(1 + 0.15 * 3)  # the prior
    costs.record(3, 0.040)
    costs.record(9, 0.080)
    assert costs.seconds(2) == pytest.approx(0.030)
    assert costs.seconds(6) == pytest.approx(0.060)
    assert costs.seconds(12) == pytest.approx(0.100)
    assert costs.relative(3) == pytest.approx(2.0) and costs.relative(9, base=3) == pytest.approx(2.0)
    assert costs.seconds(4) == pytest.approx(0.040 + 0.040 / 6)  # None while one size was known: worked out anew
    costs.replace(9, 0.140)  # a new measurement replaces what was worked out from the old one
    assert costs.seconds(6) == pytest.approx(0.090)


def test_step_costs_never_extrapolate_below_what_fewer_rows_measured() -> None:
    costs = StepCosts()  # noisy timings of a tiny model: 9 rows measured faster than 5
    costs.record(1, 0.010)
    costs.record(5, 0.030)
    costs.record(9, 0.020)
    assert costs.seconds(59) == pytest.approx(0.030)  # the line through 5 and 9 would go below 0
    assert costs.seconds(7) == pytest.approx(0.030)
    below = StepCosts()
    below.record(4, 0.020)
    below.record(8, 0.060)
    assert below.seconds(1) == pytest.approx(0.005)  # the line would give -0.01: scaled from 4 rows instead


class RepeatLast:
    """A proposer that guesses the last token again (costly in the controller's eyes: not prompt lookup)."""

    def propose(self, history: Sequence[int], limit: int) -> list[int]:
        return [history[-1]] * limit


def test_a_costly_proposer_that_keeps_missing_is_retried_ever_more_rarely() -> None:
    from mlxkv_inference.speculative.speculator import MAX_RETRY_EVERY, RETRY_EVERY

    costs = StepCosts()
    costs.record(1, 1.0)
    costs.record(2, 1.3)
    speculator = Speculator(SpeculativeParams(mode="draft", num_draft_tokens=1), RepeatLast(), costs)
    retries_at = []
    for step in range(2000):
        drafts = speculator.drafts([7], 1)
        if drafts and step > 20:
            retries_at.append(step)
        speculator.observe(drafts, [8])  # every guess misses
    gaps = [b - a for a, b in zip(retries_at, retries_at[1:])]
    assert gaps[0] >= RETRY_EVERY and gaps == sorted(gaps) and gaps[-1] == MAX_RETRY_EVERY


def test_a_draft_models_first_reading_of_the_prompt_is_not_charged_to_its_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    # A clock that only the draft model's work moves: reading a long prompt takes 100 s, a draft
    # step 1 ms, against target steps of 10 ms. Charged to the first four drafts, the prompt would
    # make drafting look 25 s a token and switch it off.
    import time

    from mlxkv_inference.binding import DEFAULT_PREFILL_CHUNK
    from mlxkv_inference.speculative.proposers import DraftModel

    draft = make_tiny_binding("llama", seed=1)
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])  # what the speculator and the draft model time with
    prefill, decode = draft.prefill, draft.decode

    def slow_prefill(*args: Any, **kwargs: Any) -> Any:
        now[0] += 100.0
        return prefill(*args, **kwargs)

    def timed_decode(*args: Any, **kwargs: Any) -> mx.array:
        now[0] += 0.001
        return decode(*args, **kwargs)

    monkeypatch.setattr(draft, "prefill", slow_prefill)
    monkeypatch.setattr(draft, "decode", timed_decode)
    costs = StepCosts()
    for rows in range(1, 6):
        costs.record(rows, 0.01 + 0.001 * (rows - 1))
    spec = Speculator(SpeculativeParams(mode="draft", num_draft_tokens=4), DraftModel(draft), costs)
    history = make_prompt(DEFAULT_PREFILL_CHUNK + 40)
    first = spec.drafts(history, 4)
    assert first and now[0] > 100.0  # the prompt was read, then drafted after
    spec.observe(first, [*first, 7])  # all accepted
    assert spec.drafts([*history, *first, 7], 4)  # drafting still pays


def test_a_step_that_traced_its_compiled_graph_is_not_timed_as_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call of a compiled step of a new size (or of new input shapes) traces it: timed
    as a step, it would cost that size ~10x for good (the adaptive length would not pick it to
    measure it again)."""
    binding = make_tiny_binding("llama", seed=4)
    compiled = binding.decode_compiled
    calls: list[tuple[int, bool]] = []  # (rows, traced) of every compiled step

    def watched(tokens: mx.array, caches: list[Any]) -> mx.array | None:
        logits = compiled(tokens, caches)
        calls.append((int(tokens.size), binding.compiled_step_traced))
        return logits

    class Recorded(StepCosts):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[int] = []

        def record(self, rows: int, seconds: float) -> None:
            self.rows.append(rows)
            super().record(rows, seconds)

    binding.verifies_positions()  # its calibration records nothing: it replaces
    binding.step_costs = costs = Recorded()
    monkeypatch.setattr(binding, "decode_compiled", watched)
    spec = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=4, adaptive=False)
    for _ in range(2):  # the second run's steps of each size are traced already, save where a buffer grew
        run(binding, repetitive_prompt(30), SAMPLINGS["greedy"], spec)
    traced = [rows for rows, t in calls if t]
    assert {rows for rows, _ in calls} == set(traced)  # every size traced once at least
    assert len(traced) < len(calls) // 2
    assert costs.rows == [rows for rows, t in calls if not t]
