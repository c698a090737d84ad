"""Adapters in the batch: rows of two adapters and of the base model interleaved in one scheduler
give each sequence bitwise the tokens it gives alone with its adapter; base rows are untouched."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, SamplingParams
from mlxkv_inference.adapters import AdapterStack, load_adapter
from mlxkv_inference.native.batched import decode_batch
from mlxkv_inference.scheduler.batch import BatchScheduler
from mlxkv_inference.speculative.speculation import SpeculativeParams
from tests.adapter_factories import adapted_caches, write_random_adapter, write_trained_adapter
from tests.factories import greedy_token, make_prompt, make_tiny_binding


@pytest.fixture(scope="module")
def native() -> MlxAutoregressiveBinding:
    return make_tiny_binding("llama", seed=4, native=True)


@pytest.fixture(scope="module")
def adapters(native: MlxAutoregressiveBinding, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    # Trained on the float32 weights the 4-bit model was quantized from (same seed).
    return [write_trained_adapter(make_tiny_binding("llama", seed=4), root / "trained", seed=1),
            write_random_adapter(native, root / "random", seed=2, rank=8, layers=[1]),
            write_random_adapter(native, root / "dora", seed=3, kind="dora")]


def test_a_batched_step_gives_every_adapted_and_base_row_its_bits_alone(
        native: MlxAutoregressiveBinding, adapters: list[Path]) -> None:
    choices: list[tuple[Path, ...]] = [(adapters[0],), (), (adapters[1],), (adapters[0],), (adapters[0], adapters[1]),
                                       (), (adapters[2],)]
    prompts = [make_prompt(3 + 4 * i, seed=i) for i in range(len(choices))]
    alone = [adapted_caches(native, *c) for c in choices]
    stacked = [adapted_caches(native, *c) for c in choices]
    for prompt, a, s in zip(prompts, alone, stacked):
        native.prefill(prompt, a)
        native.prefill(prompt, s)
    tokens = [p[-1] for p in prompts]
    for _ in range(3):
        rows = [native.decode(mx.array([t]), caches) for t, caches in zip(tokens, alone)]
        batch = native.decode_batch(mx.array(tokens), stacked)
        assert [bool(mx.array_equal(batch[r], rows[r][0]).item()) for r in range(len(choices))] == [True] * len(choices)
        tokens = [greedy_token(row[0]) for row in rows]
    plain = decode_batch(native.model, mx.array(tokens), [native.make_cache() for _ in tokens])
    base_only = native.decode_batch(mx.array(tokens), [native.make_cache() for _ in tokens])
    assert mx.array_equal(plain, base_only).item()  # no adapter, nothing swapped in


def test_two_adapters_and_the_base_interleaved_in_the_scheduler_give_their_tokens_alone(
        native: MlxAutoregressiveBinding, adapters: list[Path]) -> None:
    choices: list[tuple[Path, ...]] = [(adapters[0],), (), (adapters[1],), (adapters[0],), (), (adapters[1],)]
    specs = [(make_prompt(5 + 7 * i, seed=20 + i),
              GenerationParams(max_tokens=8 + i, prefill_chunk=8, ignore_eos=True,
                               sampling=SamplingParams() if i % 2 else SamplingParams(temperature=0.9, seed=i)))
             for i in range(len(choices))]

    def make(i: int) -> Generation:
        return Generation(native, specs[i][0], specs[i][1], caches=adapted_caches(native, *choices[i]))

    alone = [make(i).run().token_ids for i in range(len(choices))]
    scheduler = BatchScheduler(native, max_batch=6, prefill_budget=8)
    generations = [make(i) for i in range(len(choices))]
    waiting, step = list(generations), 0
    while waiting or scheduler.running:
        if waiting and step % 2 == 0:
            scheduler.add(waiting.pop(0))
        scheduler.step()
        step += 1
    assert [g.result.token_ids if g.result else None for g in generations] == alone
    assert scheduler.batched_steps > 0
    base = [Generation(native, *specs[i]).run().token_ids for i in (0, 2)]
    assert base != [alone[0], alone[2]]  # the adapters change the answers


def test_an_adapter_for_another_model_is_refused_naming_both(native: MlxAutoregressiveBinding, tmp_path: Path) -> None:
    other = make_tiny_binding("llama", seed=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    directory = write_random_adapter(other, tmp_path / "other", base_model="tiny-other")
    with pytest.raises(ValueError, match=r"trained on tiny-other\) does not fit model tiny-llama: "
                                         r"model\.layers\.0\.mlp\.down_proj: lora_a \(128, 4\) and lora_b \(4, 32\) "
                                         r"do not fit a layer of 128 inputs and 64 outputs"):
        native.adapters.tag(native.make_cache(), AdapterStack((load_adapter(directory),)))


def test_speculative_rounds_under_an_adapter_give_the_tokens_of_plain_decoding(
        native: MlxAutoregressiveBinding, adapters: list[Path]) -> None:
    prompt = make_prompt(6, seed=30) * 4  # repeats: prompt lookup finds drafts
    plain = GenerationParams(max_tokens=20, ignore_eos=True)
    spec = GenerationParams(max_tokens=20, ignore_eos=True,
                            speculative=SpeculativeParams(mode="prompt_lookup", num_draft_tokens=4, adaptive=False))
    expected = Generation(native, prompt, plain, caches=adapted_caches(native, adapters[0])).run()
    rounds = Generation(native, prompt, spec, caches=adapted_caches(native, adapters[0])).run()
    assert rounds.token_ids == expected.token_ids and rounds.draft_tokens > 0


def test_adapted_rows_batch_only_where_their_products_are_probed_row_invariant(
        native: MlxAutoregressiveBinding, adapters: list[Path]) -> None:
    sequences = [adapted_caches(native, adapters[1]), adapted_caches(native, adapters[0]), native.make_cache()]
    assert native.adapters.rows_exact(sequences, 9)
    assert native.can_decode_batch(sequences, 9)
    assert native.adapters.rows_exact([native.make_cache()], 100)  # no adapter: nothing to probe


def test_adapted_rows_whose_products_are_not_row_invariant_run_a_graph_per_row(
        adapters: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxkv_inference.adapters import bank

    fresh = make_tiny_binding("llama", seed=4, native=True)
    monkeypatch.setattr(bank, "_products_row_invariant", lambda shape, rows: False)  # as a BLAS choosing kernels by M
    sequences = [adapted_caches(fresh, adapters[1]), fresh.make_cache()]
    assert not fresh.can_decode_batch(sequences) and fresh.can_decode_batch([fresh.make_cache(), fresh.make_cache()])
