"""KV never crosses adapter namespaces: a prefix cached under one adapter is restored only under
that adapter (RAM, SSD, after a restart), never under another or the base model; a checkpoint
resumed under an adapter continues exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxkv.engine.cache_services import open_cold_tier
from mlxkv.engine.checkpoints import request_key
from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, SamplingParams
from mlxkv_inference.adapters import AdapterStack, load_adapter
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.generation.results import CheckpointState, ResumePoint
from mlxkv_inference.prompt_cache import TieredPromptCache
from tests.adapter_factories import write_random_adapter
from mlxkv_state.header import GenerationCheckpoint
from tests.factories import make_identity, make_prompt, make_tiny_binding

PARAMS = GenerationParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> MlxAutoregressiveBinding:
    return make_tiny_binding("llama", seed=6, native=True)


@pytest.fixture(scope="module")
def stacks(tiny: MlxAutoregressiveBinding, tmp_path_factory: pytest.TempPathFactory) -> dict[str, AdapterStack]:
    root = tmp_path_factory.mktemp("adapters")
    a, b = (load_adapter(write_random_adapter(tiny, root / name, seed=seed)) for name, seed in (("a", 1), ("b", 2)))
    return {"base": AdapterStack(), "a": AdapterStack((a,)), "b": AdapterStack((b,)), "a+b": AdapterStack((a, b))}


def alone(binding: MlxAutoregressiveBinding, prompt: list[int], stack: AdapterStack) -> tuple[int, ...]:
    caches = binding.adapters.tag(binding.make_cache(), stack) if stack.adapters else None
    return Generation(binding, prompt, PARAMS, caches=caches).run().token_ids


def test_a_prefix_cached_under_one_adapter_hits_only_under_it_in_ram_and_on_ssd_after_a_restart(
        tiny: MlxAutoregressiveBinding, stacks: dict[str, AdapterStack], tmp_path: Path) -> None:
    prefix = make_prompt(30, seed=1)
    prompt = prefix + make_prompt(5, seed=2)
    tiers = TieredPromptCache(1 << 30, open_cold_tier(tiny, tmp_path, 1 << 30))
    generator = CachedGenerator(tiny, tiers)
    first = generator.start(prefix, PARAMS, stacks["a"])
    first.run()
    generator.settle(first)
    assert tiers.flush().settled
    cached = {}
    for name, stack in stacks.items():  # RAM holds the prefix under "a" only
        result = generator.start(prompt, PARAMS, stack).run()
        cached[name] = result.cached_tokens
        assert result.token_ids == alone(tiny, prompt, stack)
    assert cached == {"base": 0, "a": 30, "b": 0, "a+b": 0}  # the settled prefix and its answer: 30 tokens shared
    restarted = TieredPromptCache(1 << 30, open_cold_tier(tiny, tmp_path, 1 << 30))
    generator = CachedGenerator(tiny, restarted)
    for name in ("base", "b", "a+b", "a"):  # from the SSD: a miss in every other namespace
        result = generator.start(prompt, PARAMS, stacks[name]).run()
        assert (result.cached_tokens, result.token_ids) == (30 if name == "a" else 0, alone(tiny, prompt, stacks[name]))
    assert restarted.stats().ssd_hits == 1
    restarted.close()
    tiers.close()


def test_a_checkpoint_resumed_under_its_adapter_continues_exactly(
        tiny: MlxAutoregressiveBinding, stacks: dict[str, AdapterStack], tmp_path: Path) -> None:
    store = open_cold_tier(tiny, tmp_path, 1 << 30)
    params = GenerationParams(max_tokens=14, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=3))
    prompt = make_prompt(11, seed=5)
    stack = stacks["a+b"]
    key = request_key(make_identity(tiny), stack.ns, prompt, params)
    assert key != request_key(make_identity(tiny), "", prompt, params)
    saved: list[CheckpointState] = []
    generator = CachedGenerator(tiny, None)
    expected = generator.start(prompt, params, stack, checkpoint_every=5, on_checkpoint=saved.append).run().token_ids
    state = saved[1]  # 10 tokens in
    checkpoint = GenerationCheckpoint(cache_ns=stack.ns, generated_tokens=state.generated, key=key,
                                      original_prompt_tokens=len(prompt), pending_token=state.pending, seed=state.seed,
                                      seed_was_explicit=True)
    assert store.save_checkpoint(prompt + list(state.generated), state.caches, checkpoint)
    restored = open_cold_tier(tiny, tmp_path, 1 << 30).load_checkpoint(key)  # after a restart
    assert restored is not None and restored.checkpoint.cache_ns == stack.ns
    point = ResumePoint(restored.checkpoint.generated_tokens, restored.checkpoint.pending_token)
    resumed = generator.start(prompt, params, stack, resume=(restored.caches, point)).run()
    assert resumed.token_ids == expected != alone(tiny, prompt, AdapterStack())
