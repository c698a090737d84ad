"""Adapters on the draft side of speculative decoding: a draft that is the target's base model (a
layer-skip draft of it, or the target itself) drafts under the request's adapters, cut to its
layers; a draft of another model drafts on its base. Either way the tokens are plain decoding's
under the adapter (the target verifies every draft)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding
from mlxkv_inference.adapters import load_adapter
from mlxkv_inference.adapters.bank import AdaptedCaches
from mlxkv_inference.models.draft import layer_skip_draft
from mlxkv_inference.speculative.proposers import DraftModel, draft_adapters
from mlxkv_inference.speculative.speculation import SpeculativeParams
from tests.adapter_factories import LINEARS, adapted_caches, write_random_adapter
from tests.factories import make_prompt, make_tiny_binding

PLAIN = GenerationParams(max_tokens=16, ignore_eos=True)
DRAFTED = GenerationParams(max_tokens=16, ignore_eos=True,
                           speculative=SpeculativeParams(mode="draft", num_draft_tokens=3, adaptive=False))


@pytest.fixture(scope="module")
def native() -> MlxAutoregressiveBinding:
    return make_tiny_binding("llama", seed=4, native=True)


@pytest.fixture(scope="module")
def adapter(native: MlxAutoregressiveBinding, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Large enough to change the greedy tokens: a base-model draft would be rejected often.
    return write_random_adapter(native, tmp_path_factory.mktemp("draft") / "a", seed=7, rank=8, scale=40.0)


def plain_tokens(native: MlxAutoregressiveBinding, adapter: Path, prompt: list[int]) -> tuple[int, ...]:
    return Generation(native, prompt, PLAIN, caches=adapted_caches(native, adapter)).run().token_ids


def test_a_layer_skip_draft_takes_the_request_s_adapter_cut_to_its_layers(
        native: MlxAutoregressiveBinding, adapter: Path) -> None:
    draft = layer_skip_draft(native, 1)
    stack = draft_adapters(native, draft, adapted_caches(native, adapter))
    assert [a.digest for a in stack.adapters] == [load_adapter(adapter).digest]
    assert sorted(stack.adapters[0].layers) == sorted(f"model.layers.0.{name}" for name in LINEARS)
    model = DraftModel(draft, adapters=stack)
    assert isinstance(model._caches, AdaptedCaches) and model._caches.stack is stack
    assert draft_adapters(native, draft, native.make_cache()).adapters == ()  # a base request: a base draft
    twin = make_tiny_binding("llama", seed=4, native=True)  # loaded apart: the same weights and kernels
    assert draft_adapters(native, twin, adapted_caches(native, adapter)).adapters[0].layers.keys() \
        == load_adapter(adapter).layers.keys()


def test_rounds_drafted_by_the_target_under_its_adapter_accept_every_draft_and_keep_the_tokens(
        native: MlxAutoregressiveBinding, adapter: Path) -> None:
    prompt = make_prompt(9, seed=41)
    rounds = Generation(native, prompt, DRAFTED, caches=adapted_caches(native, adapter), draft=native).run()
    assert rounds.token_ids == plain_tokens(native, adapter, prompt)
    # The draft computes what the target does (adapter included): greedy drafts all accepted.
    assert rounds.draft_tokens > 0 and rounds.accepted_tokens == rounds.draft_tokens


def test_rounds_with_a_layer_skip_draft_under_an_adapter_give_plain_decoding_s_tokens(
        native: MlxAutoregressiveBinding, adapter: Path) -> None:
    prompt = make_prompt(11, seed=42)
    rounds = Generation(native, prompt, DRAFTED, caches=adapted_caches(native, adapter),
                        draft=layer_skip_draft(native, 1)).run()
    assert rounds.token_ids == plain_tokens(native, adapter, prompt) and rounds.draft_tokens > 0


def test_a_draft_of_another_model_drafts_on_its_base_and_the_tokens_stay_exact(
        native: MlxAutoregressiveBinding, adapter: Path) -> None:
    other = make_tiny_binding("llama", seed=6, num_hidden_layers=1)
    assert draft_adapters(native, other, adapted_caches(native, adapter)).adapters == ()
    prompt = make_prompt(10, seed=43)
    rounds = Generation(native, prompt, DRAFTED, caches=adapted_caches(native, adapter), draft=other).run()
    assert rounds.token_ids == plain_tokens(native, adapter, prompt) and rounds.draft_tokens > 0
