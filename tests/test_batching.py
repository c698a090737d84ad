"""Continuous batching is exact: every row of a batched step is bitwise the row computed alone, and
every generation stepped by the scheduler (staggered, cancelled, resumed, sampled) produces the
tokens it produces running alone."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxkv_inference import Generation, GenerationParams, Grammar, MlxAutoregressiveBinding, SamplingParams
from mlxkv_inference.binding import Interrupt
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.generation.results import ResumePoint
from mlxkv_inference.scheduler.decode_step import STEP_MAX_ROWS
from mlxkv_inference.scheduler.prefill_plan import MAX_PASSED_OVER
from mlxkv_inference.scheduler.batch import BatchScheduler
from mlxkv_inference.speculative.speculation import SpeculativeParams
from mlxkv_inference.step_costs import StepCosts
from mlxkv_inference.native.batched import decode_batch, rows_invariant
from tests.factories import greedy_token, make_prompt, make_tiny_binding


def tiny(kind: str, quantized: bool, native: bool = False) -> MlxAutoregressiveBinding:
    """A tiny model: float32 (its matmuls through the BLAS loaded), or 4-bit through MLX's quantized
    matmul or, `native`, mlxkv's own matmul and attention kernels."""
    if native:
        binding = make_tiny_binding(kind, seed=4, native=True)
        assert binding.native_attention or kind == "gemma3_text"  # Gemma 3's attention stays mlx-lm's
        return binding
    binding = make_tiny_binding(kind, seed=4)
    if quantized:
        nn.quantize(binding.model, group_size=32, bits=4)
    return binding


class NeighbourDependentLinear(nn.Linear):
    """A linear layer whose arithmetic depends on the other rows of its input (as a BLAS whose
    kernel choice depends on M would): the same product, centred on the batch mean."""

    def __call__(self, x: mx.array) -> mx.array:
        mean = mx.mean(x, axis=0, keepdims=True)
        out: mx.array = (x - mean) @ self.weight.T + mean @ self.weight.T
        return out


KERNELS = [(False, False), (True, False), (True, True)]
KERNEL_IDS = ["float32", "4bit-mlx", "4bit-native"]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3_text"])
@pytest.mark.parametrize(("quantized", "native"), KERNELS, ids=KERNEL_IDS)
def test_every_row_of_a_batched_step_is_bitwise_the_row_alone(kind: str, quantized: bool, native: bool) -> None:
    binding = tiny(kind, quantized, native)
    prompts = [make_prompt(3 + 5 * i, seed=i) for i in range(8)]
    alone, stacked = [binding.make_cache() for _ in prompts], [binding.make_cache() for _ in prompts]
    for prompt, a, s in zip(prompts, alone, stacked):
        binding.prefill(prompt, a)
        binding.prefill(prompt, s)
    tokens = [p[-1] for p in prompts]
    for _ in range(3):
        rows = [binding.decode(mx.array([t]), caches) for t, caches in zip(tokens, alone)]
        batch = decode_batch(binding.model, mx.array(tokens), stacked)
        assert [bool(mx.array_equal(batch[r], rows[r][0]).item()) for r in range(8)] == [True] * 8
        tokens = [greedy_token(row) for row in rows]
    assert rows_invariant(binding.model, 8) and binding.can_decode_batch(stacked)
    assert binding.can_decode_batch(stacked, 9) and binding.can_decode_batch(stacked, 16)  # 9 rows probes up to 16


def test_a_kernel_whose_rows_depend_on_their_neighbours_is_not_batched_and_stays_exact() -> None:
    binding = make_tiny_binding("llama", seed=4)
    mlp = binding.model.model.layers[0].mlp
    swapped = NeighbourDependentLinear(mlp.down_proj.weight.shape[1], mlp.down_proj.weight.shape[0], bias=False)
    swapped.weight = mlp.down_proj.weight
    mlp.down_proj = swapped
    assert not rows_invariant(binding.model, 8)
    assert not rows_invariant(binding.model, 9, checked=8)  # a later probe checks the new sizes
    specs = make_specs(4)
    scheduler = BatchScheduler(binding, max_batch=4, prefill_budget=8)
    assert scheduled(scheduler, binding, specs) == alone(binding, specs)
    assert scheduler.batched_steps == 0


Spec = tuple[list[int], GenerationParams]


def make_specs(count: int) -> list[Spec]:
    """Different prompt lengths, seeds (greedy and sampled) and max_tokens."""
    return [
        (make_prompt(4 + 9 * i, seed=10 + i),
         GenerationParams(max_tokens=5 + 3 * i, prefill_chunk=8, ignore_eos=True,
                          sampling=SamplingParams() if i % 2 else SamplingParams(temperature=0.9, top_p=0.95, seed=i,
                                                                                  repetition_penalty=1.1)))
        for i in range(count)
    ]


def alone(binding: MlxAutoregressiveBinding, specs: list[Spec]) -> list[tuple[int, ...]]:
    return [Generation(binding, prompt, params).run().token_ids for prompt, params in specs]


def scheduled(scheduler: BatchScheduler, binding: MlxAutoregressiveBinding, specs: list[Spec],
              cancel_at: dict[int, int] | None = None, make: Callable[[Spec], Generation] | None = None) -> list[tuple[int, ...]]:
    """Run `specs` through `scheduler`, one joining every other step (so some join while others
    prefill or decode); `cancel_at` maps a spec to the step at which its generation is cancelled."""
    generations = [make(spec) if make else Generation(binding, *spec) for spec in specs]
    waiting, step = list(enumerate(generations)), 0
    while waiting or scheduler.running:
        if waiting and step % 2 == 0 and scheduler.has_room:
            scheduler.add(waiting.pop(0)[1])
        for index, at in (cancel_at or {}).items():
            if at == step:
                generations[index].cancel()
        scheduler.step()
        step += 1
    results = [g.result for g in generations]
    return [r.token_ids for r in results if r is not None]


@pytest.mark.parametrize(("kind", "quantized", "native"),
                         [("llama", False, False), ("llama", True, False), ("llama", True, True), ("qwen3", True, True),
                          ("gemma3_text", False, False), ("gemma3_text", True, True)])
def test_staggered_batch_gives_every_sequence_its_tokens_alone(kind: str, quantized: bool, native: bool) -> None:
    binding = tiny(kind, quantized, native)
    specs = make_specs(8)
    expected = alone(binding, specs)
    scheduler = BatchScheduler(binding, max_batch=8, prefill_budget=8)
    got = scheduled(scheduler, binding, specs, cancel_at={3: 9, 6: 14})
    for index in range(8):
        if index in (3, 6):  # cancelled mid-way: what it produced is the start of its tokens alone
            assert got[index] == expected[index][: len(got[index])] and len(got[index]) < len(expected[index])
        else:
            assert got[index] == expected[index]
    assert scheduler.batched_steps > 0


def test_a_rope_the_native_kernel_does_not_know_rotates_in_mlx_first_and_batches_exactly() -> None:
    """YaRN's RoPE is none the attention kernel computes itself: MLX rotates q and k (per-head
    views) before the native call. Rows batch as they run alone, and the step's logits are
    mlx-lm's attention's on the same 4-bit weights up to float rounding."""
    from mlxkv_inference.native.attention import kernel_rope

    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    binding = make_tiny_binding("llama", seed=4, native=True, rope_scaling=yarn)
    assert binding.native_attention and kernel_rope(binding.model.model.layers[0].self_attn.rope) is None
    specs = make_specs(6)
    assert scheduled(BatchScheduler(binding, max_batch=6, prefill_budget=8), binding, specs) == alone(binding, specs)
    reference = make_tiny_binding("llama", seed=4, rope_scaling=yarn)
    nn.quantize(reference.model, group_size=32, bits=4)
    prompt = make_prompt(40, seed=3)
    logits = []
    for model in (binding, reference):
        caches = model.make_cache()
        model.prefill(prompt[:-1], caches)
        logits.append(model.decode(mx.array(prompt[-1:]), caches))
    assert mx.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-3).item()


def test_a_batch_smaller_than_the_arrivals_queues_the_rest_and_stays_exact() -> None:
    binding = tiny("llama", False)
    specs = make_specs(6)
    scheduler = BatchScheduler(binding, max_batch=3, prefill_budget=8)
    assert scheduled(scheduler, binding, specs) == alone(binding, specs)


def test_a_resumed_generation_in_a_batch_continues_as_it_would_alone() -> None:
    binding = tiny("llama", True)
    specs = make_specs(4)
    full = alone(binding, specs)

    def resumed(spec: Spec) -> Generation:  # restarted after 3 tokens, as a checkpoint would hold it
        prompt, params = spec
        tokens = full[specs.index(spec)]
        caches = binding.make_cache()
        binding.prefill(prompt + list(tokens[:3]), caches)
        return Generation(binding, prompt, params, caches, resume=ResumePoint(tokens[:3], tokens[3]))

    assert scheduled(BatchScheduler(binding, max_batch=4), binding, specs, make=resumed) == full


@pytest.mark.parametrize("fixture", ["embedded", "embedded_native"])
def test_embedded_model_batch_gives_every_sequence_its_tokens_alone(fixture: str, request: pytest.FixtureRequest) -> None:
    embedded: MlxAutoregressiveBinding = request.getfixturevalue(fixture)
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
    specs = [(embedded.tokenizer.encode(t), GenerationParams(max_tokens=6 + i, sampling=SamplingParams(temperature=0.8, seed=i)
                                                             if i % 2 else SamplingParams()))
             for i, t in enumerate(texts)]
    scheduler = BatchScheduler(embedded, max_batch=4)
    assert scheduled(scheduler, embedded, specs) == alone(embedded, specs)
    assert scheduler.batched_steps > 0


def test_a_short_prompt_gets_its_first_token_while_a_long_one_still_prefills() -> None:
    binding = tiny("llama", False)
    params = GenerationParams(max_tokens=4, prefill_chunk=8, ignore_eos=True)
    long, short = Generation(binding, make_prompt(200, seed=1), params), Generation(binding, make_prompt(6, seed=2), params)
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=8)  # one chunk a step
    scheduler.add(long)
    scheduler.step()
    scheduler.add(short)
    first_token_at = None
    for step in range(1, 30):
        outcomes = {id(o.generation): o for o in scheduler.step()}
        if id(short) in outcomes and any(d.step is not None for d in outcomes[id(short)].deltas):
            first_token_at = step
            break
    assert first_token_at is not None and first_token_at <= 2 and long.prefilling
    while scheduler.running:
        scheduler.step()
    assert long.result is not None and short.result is not None
    assert (long.result.token_ids, short.result.token_ids) == tuple(
        Generation(binding, g.prompt, params).run().token_ids for g in (long, short))


def test_chunks_cut_to_the_step_budget_keep_every_token_where_the_forward_is_chunk_invariant() -> None:
    """With chunks of 64 and a budget of 5 tokens a step, the scheduler cuts prompts at points
    no lone run has; the tokens stay those of running alone (the model's forward is probed
    chunk-invariant), and the shortest prompt completes first."""
    binding = tiny("llama", False)
    params = GenerationParams(max_tokens=6, prefill_chunk=64, ignore_eos=True)
    prompts = [make_prompt(41, seed=1), make_prompt(23, seed=2), make_prompt(4, seed=3)]
    generations = [Generation(binding, p, params) for p in prompts]
    scheduler = BatchScheduler(binding, max_batch=3, prefill_budget=5)
    assert binding.verifies_positions()
    for generation in generations:
        scheduler.add(generation)
    scheduler.step()
    assert [g.prefilling for g in generations] == [True, True, False]
    while scheduler.running:
        scheduler.step()
    assert [g.result.token_ids for g in generations if g.result is not None] == [
        Generation(binding, p, params).run().token_ids for p in prompts]


def test_a_time_bounded_prefill_step_cuts_chunks_from_the_last_chunks_speed() -> None:
    """A step bound far below any real chunk: every chunk is the fewest tokens a timed step feeds
    (the first one too, sized from the binding's step costs); the tokens stay those of running
    alone."""
    binding = tiny("llama", False)
    params = GenerationParams(max_tokens=3, prefill_chunk=64, ignore_eos=True)
    generation = Generation(binding, make_prompt(100, seed=4), params)
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=64, prefill_step_s=1e-9)
    scheduler.add(generation)
    left = []
    while generation.prefilling:
        scheduler.step()
        left.append(generation.prefill_left)
    assert left == list(range(91, 0, -8)) + [0]
    while scheduler.running:
        scheduler.step()
    assert generation.result is not None
    assert generation.result.token_ids == Generation(binding, make_prompt(100, seed=4), params).run().token_ids


def test_a_time_bounded_step_gives_its_time_to_one_turn_when_no_more_fits() -> None:
    """The bound is the step's: once one prompt's turn has used it, the other prompt waits for the
    next step (8 tokens a step in all, not 8 each); each still gets its tokens alone."""
    binding = tiny("llama", False)
    params = GenerationParams(max_tokens=3, prefill_chunk=64, ignore_eos=True)
    prompts = [make_prompt(60, seed=5), make_prompt(30, seed=6)]
    generations = [Generation(binding, p, params) for p in prompts]
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=64, prefill_step_s=1e-9)
    for generation in generations:
        scheduler.add(generation)
    left = [sum(g.prefill_left for g in generations)]
    while any(g.prefilling for g in generations):
        scheduler.step()
        left.append(sum(g.prefill_left for g in generations))
    fed = [before - after for before, after in zip(left, left[1:])]
    assert len(fed) == math.ceil(59 / 8) + math.ceil(29 / 8) and all(1 <= n <= 8 for n in fed)  # one turn a step
    while scheduler.running:
        scheduler.step()
    assert [g.result.token_ids for g in generations if g.result is not None] == [
        Generation(binding, p, params).run().token_ids for p in prompts]


@pytest.mark.parametrize(("token_seconds", "whole"), [(0.01, True), (0.02, False)])
def test_a_prompt_within_one_chunk_and_about_one_step_is_not_cut(token_seconds: float, whole: bool) -> None:
    """Under a 0.3 s step bound, a 35-token prompt estimated at 0.35 s (within 2 steps and one
    chunk) prefills in one step: cutting it would only delay its own first token. Estimated at
    0.7 s it is cut to the bound. (The estimate is the binding's step costs, set here.)"""
    binding = tiny("llama", False)
    assert binding.verifies_positions()  # its own calibration first, then the costs this test sets
    binding.step_costs = StepCosts()
    binding.step_costs.record(1, token_seconds)
    binding.step_costs.record(64, 64 * token_seconds)
    params = GenerationParams(max_tokens=3, prefill_chunk=64, ignore_eos=True)
    generation = Generation(binding, make_prompt(36, seed=8), params)
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=64, prefill_step_s=0.3)
    scheduler.add(generation)
    scheduler.step()
    assert (generation.prefill_left == 0) is whole
    while scheduler.running:
        scheduler.step()
    assert generation.result is not None
    assert generation.result.token_ids == Generation(binding, make_prompt(36, seed=8), params).run().token_ids


def test_a_new_prompt_is_estimated_from_the_latest_first_chunk_not_from_decode_costs() -> None:
    """Decode-row costs say a prompt token takes 1 s; the tiny model's real first chunk (of the
    first prompt, uncached) takes milliseconds. The next uncached prompt is estimated from that
    chunk, so under a 0.3 s bound it prefills whole in one step instead of 8 tokens a step."""
    binding = tiny("llama", False)
    assert binding.verifies_positions()
    binding.step_costs = StepCosts()
    binding.step_costs.record(1, 1.0)
    binding.step_costs.record(64, 64.0)
    params = GenerationParams(max_tokens=2, prefill_chunk=64, ignore_eos=True)
    first, second = (Generation(binding, make_prompt(36, seed=s), params) for s in (9, 10))
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=64, prefill_step_s=0.3)
    scheduler.add(first)
    scheduler.step()
    assert first.prefill_left == 35 - 8  # estimated from the decode costs: the fewest timed tokens
    while scheduler.running:
        scheduler.step()
    scheduler.add(second)
    scheduler.step()
    assert second.prefill_left == 0


def test_a_prompt_prefills_through_its_snapshot_points_in_one_step() -> None:
    """A prompt within the step's budget completes in one step although its prefill stops to
    snapshot at a point on the way (a chat's history end): the point is still taken, and the
    tokens are those of running alone."""
    binding = tiny("llama", False)
    params = GenerationParams(max_tokens=4, prefill_chunk=64, ignore_eos=True)
    prompt = make_prompt(30, seed=7)
    snapshots: list[int] = []
    generation = Generation(binding, prompt, params, snapshot_at=[12, 29],
                            on_snapshot=lambda tokens, caches: snapshots.append(len(tokens)))
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=64)
    scheduler.add(generation)
    outcomes = scheduler.step()
    assert not generation.prefilling and snapshots == [12, 29]
    assert [d.step is not None for d in outcomes[0].deltas] == [True]  # its first token came in the same step
    while scheduler.running:
        scheduler.step()
    assert generation.result is not None
    assert generation.result.token_ids == Generation(binding, prompt, params).run().token_ids


def test_grammar_constrained_rows_batch_with_free_ones_and_match_their_tokens_alone() -> None:
    binding = tiny("llama", True, True)
    pattern = r"[a-z]{3}-[0-9]{2,4}"
    specs = [(prompt, replace(params, grammar=Grammar("regex", pattern), ignore_eos=False) if i % 2 else params)
             for i, (prompt, params) in enumerate(make_specs(6))]
    scheduler = BatchScheduler(binding, max_batch=6, prefill_budget=8)
    got = scheduled(scheduler, binding, specs)
    assert got == alone(binding, specs) and scheduler.batched_steps > 0
    assert all(re.fullmatch(pattern, binding.tokenizer.decode(list(tokens))) for tokens in got[1::2])


def test_a_batch_of_native_and_quantized_kv_rows_gives_every_sequence_its_tokens_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # KV quantization starts at 40 positions: longer prompts cross it while shorter ones still
    # attend through the native kernel, so steps mix both kinds of rows.
    from mlxkv_inference import KvScheme
    from mlxkv_inference.native import batched

    binding = make_tiny_binding("llama", seed=4, native=True, head_dim=64,
                                kv_scheme=KvScheme(bits=8, group_size=32, quantized_start=40))
    mixed_steps = []
    real = batched._mixed_attention

    def counted(*args: object, **kwargs: object) -> mx.array:
        mixed_steps.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(batched, "_mixed_attention", counted)
    specs = make_specs(6)
    expected = alone(binding, specs)
    assert scheduled(BatchScheduler(binding, max_batch=6, prefill_budget=8), binding, specs) == expected
    assert mixed_steps


@pytest.mark.parametrize("max_batch", [4, 8])
def test_a_long_prompt_under_a_stream_of_short_ones_still_prefills(max_batch: int) -> None:
    """Least-prompt-left-first alone would give every step to a short prompt: a long prompt passed
    over `MAX_PASSED_OVER` steps in a row takes the next turn, which the next short prompt waiting
    does not stop. With 8 in the batch and room for one short prompt a step, shorts starve too:
    the longest passed over goes first, so they cannot keep the long one waiting either."""
    binding = tiny("llama", False)
    params = GenerationParams(max_tokens=1, prefill_chunk=8, ignore_eos=True)
    long = Generation(binding, make_prompt(120, seed=1), params)
    scheduler = BatchScheduler(binding, max_batch=max_batch, prefill_budget=8 if max_batch == 4 else 4)
    scheduler.add(long)
    before, chunk = long.prefill_left, scheduler.prefill_budget
    shorts: list[Generation] = []
    steps = 5 * (MAX_PASSED_OVER + 1)
    for step in range(steps):
        while scheduler.has_room:  # a request waits for every free place
            shorts.append(Generation(binding, make_prompt(5, seed=10 + len(shorts)), params))
            scheduler.add(shorts[-1])
        scheduler.step(arrival=lambda: 5)
    # A turn every MAX_PASSED_OVER + 1 steps; with starved shorts, once it has waited longer than
    # every short in the batch.
    turns = steps // (max(max_batch, MAX_PASSED_OVER) + 1)
    assert long.prefilling and before - long.prefill_left >= chunk * turns
    run_out_as_alone(scheduler, binding, [long, *shorts], params)


def run_out_as_alone(scheduler: BatchScheduler, binding: MlxAutoregressiveBinding, generations: list[Generation],
                     params: GenerationParams) -> None:
    """Steps `scheduler` until every generation ended: each got the tokens of its prompt run alone with `params`."""
    while scheduler.running:
        scheduler.step()
    for generation in generations:
        assert generation.result is not None
        assert generation.result.token_ids == Generation(binding, generation.prompt, params).run().token_ids


class RecordsForwards(MlxAutoregressiveBinding):
    """Records each batched forward's rows a sequence and rows of logits a sequence, and counts
    the forwards a prefill feeds on its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[list[int], list[int] | None]] = []
        self.fed = 0

    def decode_batch(self, tokens: mx.array, caches: Sequence[list[LayerCache]],
                     lengths: Sequence[int] | None = None, logits_of: Sequence[int] | None = None) -> mx.array:
        self.batches.append((list(lengths or [1] * len(caches)), None if logits_of is None else list(logits_of)))
        return super().decode_batch(tokens, caches, lengths, logits_of)

    def feed(self, tokens: Sequence[int], caches: list[LayerCache], interrupt: Interrupt | None = None) -> int:
        self.fed += 1
        return super().feed(tokens, caches, interrupt)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=3)])
def test_a_short_prompt_rides_in_the_decode_step_and_gets_the_tokens_it_gets_alone(sampling: SamplingParams) -> None:
    """A prompt whose rest fits the step is fed with its first decode step (`Generation.join`):
    alone, one forward instead of a prefill and a step; joining running rows, their step is its
    prefill. No forward of its own either way, its first token comes from that step, and every
    generation's tokens are those of running alone."""
    binding = make_tiny_binding("llama", seed=4, native=True, binding_class=RecordsForwards)
    assert isinstance(binding, RecordsForwards) and binding.verifies_positions()
    params = GenerationParams(max_tokens=6, prefill_chunk=64, ignore_eos=True, sampling=sampling)
    first, second = (Generation(binding, make_prompt(n, seed=n), params) for n in (20, 25))
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=64)
    scheduler.add(first)
    binding.batches.clear()
    [alone_step] = scheduler.step()
    assert binding.batches == [([20], [1])] and binding.fed == 0
    assert [d.step.step for d in alone_step.deltas if d.step is not None] == [0]
    scheduler.add(second)
    outcomes = {id(o.generation): o for o in scheduler.step()}
    assert binding.batches[-1] == ([1, 25], [1, 1]) and binding.fed == 0
    assert [d.step.step for d in outcomes[id(second)].deltas if d.step is not None] == [0]
    run_out_as_alone(scheduler, binding, [first, second], params)


def test_a_prompt_whose_rest_would_cross_the_kv_quantization_start_prefills_on_its_own() -> None:
    """The same rule as a speculative round's (`round_fits`): one forward over positions past the
    quantization start would attend them unquantized, where single steps see them quantized."""
    from mlxkv_inference import KvScheme

    binding = make_tiny_binding("llama", seed=4, native=True, head_dim=64, binding_class=RecordsForwards,
                                kv_scheme=KvScheme(bits=8, group_size=32, quantized_start=16))
    assert isinstance(binding, RecordsForwards)
    params = GenerationParams(max_tokens=4, prefill_chunk=64, ignore_eos=True)
    short, long = Generation(binding, make_prompt(12, seed=1), params), Generation(binding, make_prompt(30, seed=2), params)
    assert short.can_join(64) and not long.can_join(64)
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=64)
    for generation in (short, long):
        scheduler.add(generation)
    scheduler.step()
    assert binding.fed > 0 and binding.batches[0] == ([12, 1], [1, 1])
    run_out_as_alone(scheduler, binding, [short, long], params)


def test_the_logits_of_chosen_rows_are_bitwise_those_rows_of_the_whole_step() -> None:
    binding = tiny("llama", True, True)
    prompts = [make_prompt(n, seed=n) for n in (5, 9, 7)]
    whole, chosen = ([binding.make_cache() for _ in prompts] for _ in range(2))
    for prompt, a, b in zip(prompts, whole, chosen):
        binding.prefill(prompt[:-4], a)
        binding.prefill(prompt[:-4], b)
    tokens = mx.array([prompts[0][-4], *prompts[1][-4:], prompts[2][-4]])
    lengths = [1, 4, 1]
    every = decode_batch(binding.model, tokens, whole, lengths)
    some = decode_batch(binding.model, tokens, chosen, lengths, [1, 2, 1])
    assert some.shape[0] == 4 and mx.array_equal(some, every[mx.array([0, 3, 4, 5])]).item()


class RefusesBatches(RecordsForwards):
    """Batches only until `refuse` is set (a step that outgrew what its join was decided for)."""

    refuse = False

    def can_decode_batch(self, caches: Sequence[Sequence[LayerCache]], rows: int | None = None) -> bool:
        return not self.refuse and super().can_decode_batch(caches, rows)


def test_a_joined_prompt_whose_step_cannot_batch_runs_its_own_forward_and_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decided to join, then the step runs a graph per row: the prompt's rest and its last token
    go through its own graph in one forward; the snapshot and the progress of its prefill are
    reported once that step is taken, from caches holding the whole prompt."""
    binding = make_tiny_binding("llama", seed=4, native=True, binding_class=RefusesBatches)
    assert isinstance(binding, RefusesBatches) and binding.verifies_positions()
    params = GenerationParams(max_tokens=5, prefill_chunk=64, ignore_eos=True)
    prompt = make_prompt(24, seed=6)
    snapshots: list[tuple[int, int]] = []
    progress: list[tuple[int, int]] = []
    generation = Generation(binding, prompt, params, snapshot_at=[10, 23], on_prefill_progress=lambda *p: progress.append(p),
                            on_snapshot=lambda tokens, caches: snapshots.append((len(tokens), caches[0].offset)))
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=64)
    scheduler.add(generation)
    prefill = scheduler._prefill

    def then_refuse(*args: Any) -> None:
        prefill(*args)
        binding.refuse = True

    monkeypatch.setattr(scheduler, "_prefill", then_refuse)
    [outcome] = scheduler.step()
    assert binding.batches == [] and binding.fed == 0 and [d.step is not None for d in outcome.deltas] == [True]
    assert snapshots == [(10, 24), (23, 24)] and progress == [(0, 23), (23, 23)]
    run_out_as_alone(scheduler, binding, [generation], params)


def test_a_new_prompt_is_estimated_from_the_latest_joined_prompts_step() -> None:
    """A prompt that rode in a decode step had no chunk of its own to time: that step's seconds a
    position are what the next new prompt is estimated at (not decode-row costs of 1 s a token,
    which would cut it to the fewest timed tokens)."""
    binding = tiny("llama", False)
    assert binding.verifies_positions()
    params = GenerationParams(max_tokens=2, prefill_chunk=64, ignore_eos=True)
    first, second = (Generation(binding, make_prompt(n, seed=n), params) for n in (20, 36))
    scheduler = BatchScheduler(binding, max_batch=2, prefill_budget=64, prefill_step_s=0.3)
    scheduler.add(first)
    scheduler.step()
    assert not first.prefilling and first.result is None  # joined: its first token in that step
    while scheduler.running:
        scheduler.step()
    binding.step_costs = StepCosts()
    binding.step_costs.record(1, 1.0)
    binding.step_costs.record(64, 64.0)
    scheduler.add(second)
    scheduler.step()
    assert second.prefill_left == 0 and not second.prefilling


def test_a_batched_step_keeps_its_drafts_within_the_rows_probed_for_it() -> None:
    """Generations drafting all they can (the model drafting for itself: every draft accepted),
    alone and next to a joined prompt: their drafts are cut so the step stays within
    `STEP_MAX_ROWS` (a step past the rows probed would stall every sequence on a new probe), and
    every generation still gets the tokens it gets alone without speculating."""
    binding = make_tiny_binding("llama", seed=4, native=True, binding_class=RecordsForwards)
    assert isinstance(binding, RecordsForwards) and binding.verifies_positions()
    eager = SpeculativeParams(mode="draft", num_draft_tokens=32, adaptive=False)
    params = GenerationParams(max_tokens=80, prefill_chunk=64, ignore_eos=True, speculative=eager)
    running = [Generation(binding, make_prompt(12, seed=20 + i), params, draft=binding) for i in range(3)]
    scheduler = BatchScheduler(binding, max_batch=4, prefill_budget=64)
    for generation in running:
        scheduler.add(generation)
    scheduler.step()
    scheduler.step()
    assert sum(binding.batches[-1][0]) == STEP_MAX_ROWS  # not 3 x (1 + 32) rows
    assert binding.batches[-1][0][0] == 33  # the first drafts all it may
    newcomer = Generation(binding, make_prompt(STEP_MAX_ROWS - 10, seed=3), params, draft=binding)
    scheduler.add(newcomer)
    binding.batches.clear()
    scheduler.step()
    [(lengths, logits_of)] = binding.batches
    assert logits_of is not None and lengths[-1] == STEP_MAX_ROWS - 10 and logits_of[-1] == 1
    assert sum(lengths) == STEP_MAX_ROWS and lengths[0] > 1  # drafts, cut to the room left
    run_out_as_alone(scheduler, binding, [*running, newcomer], replace(params, speculative=SpeculativeParams()))
