"""Adapters over HTTP: requests select adapters by `model` (NAME, <model id>:NAME, NAME+NAME2) or
mlx_lm.server's `adapters` field; requests under two adapters and the base, sent together and
batched, each get the text they get alone; an unknown adapter is a 404 in the API's shape."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_serve import ServeConfig, build_app
from tests.adapter_factories import write_random_adapter, write_trained_adapter
from tests.factories import make_tiny_binding
from tests.serving import running

# (model, adapters field, sampling): base, alpha, beta, the stack, beta by field, alpha by its path, seeded ones
CASES: list[tuple[str, Any, dict[str, Any]]] = [
    ("tiny-llama", None, {}), ("alpha", None, {}), ("tiny-llama:beta", None, {}), ("alpha+beta", None, {}),
    ("anything", ["beta"], {}), ("x", "ALPHA_PATH", {}), ("alpha", None, {"temperature": 0.9, "seed": 3}),
    ("tiny-llama", None, {"temperature": 0.9, "seed": 3}),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LocalEngine, Path]]:
    binding: MlxAutoregressiveBinding = make_tiny_binding("llama", seed=4, native=True)
    root = tmp_path_factory.mktemp("adapters")
    alpha = write_trained_adapter(make_tiny_binding("llama", seed=4), root / "alpha", seed=1)
    beta = write_random_adapter(binding, root / "beta", seed=2, rank=8)
    engine = LocalEngine(binding, None, max_batch=8)
    engine.adapters.add("alpha", alpha)
    engine.adapters.add("beta", beta)
    config = ServeConfig(vocab_size=binding.tokenizer.vocab_size, default_max_tokens=12, max_body_bytes=1 << 20)
    with running(build_app(engine, config)) as url:
        yield url, engine, alpha
    engine.close(30)


def complete(url: str, model: str, adapters: Any, sampling: dict[str, Any], alpha: Path) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, **sampling}
    if adapters is not None:
        body["adapters"] = str(alpha) if adapters == "ALPHA_PATH" else adapters
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_requests_under_two_adapters_and_the_base_batched_get_their_text_alone(served: tuple[str, LocalEngine, Path]) -> None:
    url, engine, alpha = served
    alone = [complete(url, model, adapters, sampling, alpha).json()["choices"][0]["text"]
             for model, adapters, sampling in CASES]
    before = engine.batched_steps
    with ThreadPoolExecutor(len(CASES)) as pool:
        together = list(pool.map(lambda case: complete(url, case[0], case[1], case[2], alpha).json()["choices"][0]["text"],
                                 CASES))
    assert together == alone
    assert engine.batched_steps > before
    base, by_alpha, by_beta, stacked, beta_field, alpha_path = alone[:6]
    assert len({base, by_alpha, by_beta, stacked}) == 4  # each adapter (and the stack) answers differently
    assert (beta_field, alpha_path) == (by_beta, by_alpha)


@pytest.mark.parametrize(("model", "adapters", "param"), [("tiny-llama:gamma", None, "model"), ("m", ["alpha", "gamma"], "adapters")])
def test_an_unknown_adapter_is_a_404_in_the_openai_shape(model: str, adapters: Any, param: str,
                                                         served: tuple[str, LocalEngine, Path]) -> None:
    url, _, alpha = served
    response = complete(url, model, adapters, {}, alpha)
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", param)
    assert error["message"] == f"no adapter named 'gamma' is loaded (in '{param}'); loaded: alpha, beta"


def test_a_bad_adapters_field_is_a_400(served: tuple[str, LocalEngine, Path]) -> None:
    url, _, alpha = served
    response = complete(url, "m", [3], {}, alpha)
    assert response.status_code == 400 and response.json()["error"]["param"] == "adapters"


def test_models_lists_each_adapter_under_the_model(served: tuple[str, LocalEngine, Path]) -> None:
    url, _, _ = served
    listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in listed] == ["tiny-llama", "tiny-llama:alpha", "tiny-llama:beta"]
    assert httpx.get(f"{url}/v1/models/tiny-llama:beta", timeout=30).json()["id"] == "tiny-llama:beta"
    assert httpx.get(f"{url}/v1/models/tiny-llama:gamma", timeout=30).status_code == 404


def test_clients_add_and_remove_adapters_only_under_the_allowed_directory(
        served: tuple[str, LocalEngine, Path], tmp_path: Path) -> None:
    url, engine, alpha = served
    allowed = tmp_path / "allowed"
    gamma = write_random_adapter(engine.binding, allowed / "gamma", seed=7)
    outside = write_random_adapter(engine.binding, tmp_path / "outside", seed=8)
    (allowed / "broken").mkdir()
    (allowed / "broken" / "adapter_config.json").write_text('{"lora_parameters": {"scale": 2.0}}')
    (allowed / "broken" / "adapters.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")

    def post(name: str, path: Path) -> httpx.Response:
        return httpx.post(f"{url}/v1/adapters", json={"name": name, "path": str(path)}, timeout=60)

    assert post("gamma", gamma).status_code == 403  # no --adapter-dir yet
    engine.adapters.allowed_dirs = (allowed.resolve(),)
    try:
        assert post("outside", outside).status_code == 403
        assert post("link", allowed / ".." / "outside").status_code == 403
        broken = post("broken", allowed / "broken")
        assert broken.status_code == 400 and "is not a readable safetensors file (the header is not JSON" in broken.json()["error"]["message"]
        added = post("gamma", gamma)
        assert added.status_code == 200 and added.json()["id"] == "tiny-llama:gamma"
        assert post("gamma", gamma).status_code == 400  # the name is taken
        answer = complete(url, "gamma", None, {}, alpha)
        assert answer.status_code == 200
        assert httpx.delete(f"{url}/v1/adapters/elsewhere:gamma", timeout=30).status_code == 404  # another model's id
        assert httpx.delete(f"{url}/v1/adapters/tiny-llama:gamma", timeout=30).json() == {
            "id": "tiny-llama:gamma", "object": "adapter", "deleted": True}  # the id POST answered
        assert complete(url, "tiny-llama:gamma", None, {}, alpha).status_code == 404
        assert httpx.delete(f"{url}/v1/adapters/gamma", timeout=30).status_code == 404
        assert post("gamma2", gamma).status_code == 200  # the same files again: the same digest, its KV
        assert complete(url, "gamma2", None, {}, alpha).json()["choices"][0]["text"] == answer.json()["choices"][0]["text"]
        assert httpx.delete(f"{url}/v1/adapters/gamma2", timeout=30).json()["id"] == "tiny-llama:gamma2"  # a bare name
    finally:
        engine.adapters.allowed_dirs = ()
        engine.adapters.remove("gamma2")
