"""Adapters with several models (`mlxkv serve --model a=... --model b=... --adapter a:NAME=PATH`):
a request names `MODEL:NAME` and gets what a one-model server with that adapter answers; a bare
`NAME=PATH` goes to --default-model; an adapter of another base fails only its model's load."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from mlxkv.commands.serve import load_engine
from tests.adapter_factories import write_random_adapter
from tests.factories import make_tiny_binding
from tests.factories import save_mlx_lm_directory
from tests.test_serve_models import answer, complete, serve_args, serving


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny models, an adapter of the first (`sql`) and one of a model of other shapes (`other`)."""
    root = tmp_path_factory.mktemp("models")
    llama = make_tiny_binding("llama", seed=3)
    save_mlx_lm_directory(llama, root / "tiny-llama")
    save_mlx_lm_directory(make_tiny_binding("qwen3", seed=5), root / "tiny-qwen3")
    other = make_tiny_binding("llama", seed=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    return {"a": root / "tiny-llama", "b": root / "tiny-qwen3", "sql": write_random_adapter(llama, root / "sql", seed=1),
            "other": write_random_adapter(other, root / "other", base_model="tiny-other")}


def two_models(models: dict[str, Path], *flags: str) -> list[str]:
    return ["--model", f"a={models['a']}", "--model", f"b={models['b']}", *flags]


def test_an_adapter_bound_to_one_of_several_models_answers_as_on_its_one_model_server(models: dict[str, Path]) -> None:
    with serving(serve_args("--model", str(models["a"]), "--adapter", f"sql={models['sql']}")) as (url, _):
        alone = answer(complete(url, "sql"))[1], answer(complete(url, "base"))[1]
    with serving(serve_args(*two_models(models, "--adapter", f"a:sql={models['sql']}"))) as (url, _):
        adapted, base = answer(complete(url, "a:sql")), answer(complete(url, "a"))
        unknown = complete(url, "a:nope")
        listed = [(m["id"], m["state"]) for m in httpx.get(url + "/v1/models").json()["data"]]
        retrieved = httpx.get(url + "/v1/models/a:sql").json()
    assert (adapted, base) == (("a", alone[0], 0), ("a", alone[1], 0))  # the adapter's KV is its own namespace
    assert alone[0] != alone[1]
    assert listed == [("a", "loaded"), ("a:sql", "loaded"), ("b", "unloaded")] and retrieved["id"] == "a:sql"
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == (
        "no adapter named 'nope' is loaded (in 'model'); loaded: sql")


def test_a_bare_adapter_goes_to_the_default_model_and_needs_one(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"^--adapter sql=.*: with several models, bind it to one \(--adapter MODEL:sql=PATH"):
        load_engine(serve_args(*two_models(models, "--adapter", f"sql={models['sql']}")))
    with serving(serve_args(*two_models(models, "--adapter", f"a:sql={models['sql']}"))) as (url, _):
        bound = answer(complete(url, "a:sql"))[1]
    with serving(serve_args(*two_models(models, "--default-model", "a", "--adapter", f"sql={models['sql']}"))) as (url, _):
        by_default = answer(complete(url, "sql"))
    assert by_default == ("a", bound, 0)


@pytest.mark.parametrize(("flags", "message"), [
    (["--model", "MODELS_A", "--adapter", "a:sql=SQL"], "MODEL: binds an adapter to one of several models; with one --model give sql=PATH"),
    (["--model", "a=MODELS_A", "--model", "b=MODELS_B", "--adapter", "c:sql=SQL"], "no model is registered as 'c' (registered: a, b)"),
])
def test_an_adapter_bound_to_no_served_model_stops_the_server(models: dict[str, Path], flags: list[str], message: str) -> None:
    values = {"MODELS_A": str(models["a"]), "a=MODELS_A": f"a={models['a']}", "b=MODELS_B": f"b={models['b']}",
              "a:sql=SQL": f"a:sql={models['sql']}", "c:sql=SQL": f"c:sql={models['sql']}"}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_engine(serve_args(*[values.get(f, f) for f in flags]))


def test_an_adapter_of_another_base_fails_its_models_load_and_the_other_keeps_serving(models: dict[str, Path]) -> None:
    with serving(serve_args(*two_models(models, "--adapter", f"b:o={models['other']}"))) as (url, _):
        failed = complete(url, "b")
        served = complete(url, "a")
        listed = {m["id"]: m["state"] for m in httpx.get(url + "/v1/models").json()["data"]}
    assert failed.status_code == 503
    message = failed.json()["error"]["message"]
    assert message.startswith("the model 'b' failed to load: AdapterMismatchError: ") and "(trained on tiny-other)" in message
    assert served.status_code == 200 and listed == {"a": "loaded", "b": "failed", "b:o": "failed"}
