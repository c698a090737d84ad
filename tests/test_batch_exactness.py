"""`--batch-exactness strict|relaxed`: strict batches only through kernels probed row-invariant
(today's behaviour); relaxed batches through any kernel, says so, and keys its KV apart."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from mlxkv.cli import build_parser
from mlxkv.commands.options import apply_batch_exactness
from mlxkv_inference import Generation, MlxAutoregressiveBinding
from mlxkv_inference.batch_exactness import RELAXED_NOTICE, check_batch_exactness, exactness_fingerprint
from mlxkv_inference.native.batched import rows_invariant
from mlxkv_inference.scheduler.batch import BatchScheduler
from mlxkv_serve import ServeConfig
from tests.factories import make_tiny_binding
from tests.server_process import ServerProcess
from tests.test_batching import NeighbourDependentLinear, alone, make_specs, scheduled


def neighbour_dependent_binding() -> MlxAutoregressiveBinding:
    """A tiny llama whose down projection centres its rows on the batch mean (as a BLAS that picks
    its kernel by the number of rows): the row-invariance probe rejects it."""
    binding = make_tiny_binding("llama", seed=4)
    mlp = binding.model.model.layers[0].mlp
    swapped = NeighbourDependentLinear(mlp.down_proj.weight.shape[1], mlp.down_proj.weight.shape[0], bias=False)
    swapped.weight = mlp.down_proj.weight
    mlp.down_proj = swapped
    return binding


def test_the_flag_parses_for_generate_and_serve_and_defaults_to_strict() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).batch_exactness == "strict"
    assert parser.parse_args(["serve", "--batch-exactness", "relaxed"]).batch_exactness == "relaxed"
    assert parser.parse_args(["generate", "--batch-exactness", "relaxed", "hi"]).batch_exactness == "relaxed"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--batch-exactness", "loose"])
    with pytest.raises(ValueError, match="'loose' is not one of strict, relaxed"):
        check_batch_exactness("loose")


def test_relaxed_kv_has_its_own_fingerprint_and_strict_keeps_the_old_one() -> None:
    binding = make_tiny_binding("llama", seed=1)
    strict = binding.config_fingerprint
    apply_batch_exactness(build_parser().parse_args(["serve", "--batch-exactness", "relaxed"]), binding)
    assert binding.batch_exactness == "relaxed"
    assert binding.config_fingerprint == exactness_fingerprint(strict, "relaxed") != strict
    assert len(binding.config_fingerprint) == len(strict) == 32
    binding.use_batch_exactness("strict")
    assert binding.config_fingerprint == strict == make_tiny_binding("llama", seed=1).config_fingerprint


def test_relaxed_batches_a_model_whose_kernel_strict_refuses_to_batch() -> None:
    specs = make_specs(4)
    strict = neighbour_dependent_binding()
    assert not rows_invariant(strict.model, 4)
    strict_scheduler = BatchScheduler(strict, max_batch=4, prefill_budget=8)
    assert scheduled(strict_scheduler, strict, specs) == alone(strict, specs)  # a graph per row: exact
    assert strict_scheduler.batched_steps == 0

    relaxed = neighbour_dependent_binding()
    relaxed.use_batch_exactness("relaxed")
    relaxed_scheduler = BatchScheduler(relaxed, max_batch=4, prefill_budget=8)
    got = scheduled(relaxed_scheduler, relaxed, specs)
    assert relaxed_scheduler.batched_steps > 0
    assert [len(tokens) for tokens in got] == [params.max_tokens for _, params in specs]
    assert relaxed.can_decode_batch([relaxed.make_cache() for _ in range(4)]) and not strict.can_decode_batch(
        [strict.make_cache() for _ in range(4)])


def test_a_graph_that_cannot_batch_stays_unbatched_when_relaxed() -> None:
    binding = make_tiny_binding("qwen3_next", seed=2)  # recurrent layers: a graph per row
    binding.use_batch_exactness("relaxed")
    specs = make_specs(3)
    scheduler = BatchScheduler(binding, max_batch=3, prefill_budget=8)
    assert scheduled(scheduler, binding, specs) == [Generation(binding, *spec).run().token_ids for spec in specs]
    assert scheduler.batched_steps == 0


def test_a_relaxed_server_says_so_at_start_up_and_on_health(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "cache", "--batch-exactness", "relaxed")
    try:
        health = httpx.get(server.url + "/health").json()
    finally:
        server.stop()
    assert health["batch_exactness"] == "relaxed"
    assert RELAXED_NOTICE in server.log.read_text()
    assert ServeConfig(vocab_size=2).batch_exactness == "strict"  # what a server without the flag reports
