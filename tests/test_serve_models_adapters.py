"""Adapters with several models (`mlxkv serve --model a=... --model b=... --adapter a:NAME=PATH`):
a request names `MODEL:NAME` and gets what a one-model server with that adapter answers; a bare
`NAME=PATH` goes to --default-model; an adapter of another base fails only its model's load."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxkv.cli import build_parser
from mlxkv.commands.serve import load_engine
from tests.adapter_factories import write_random_adapter
from tests.factories import make_tiny_binding
from tests.factories import save_mlx_lm_directory
from mlxkv_serve import ServeConfig, build_app
from tests.serving import running
from tests.test_serve_models import answer, complete, serve_args, serving, states


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


@pytest.fixture(scope="module")
def alone(models: dict[str, Path]) -> tuple[str, str]:
    """The one-model server's answers for `a` under `sql` and on its base."""
    with serving(serve_args("--model", str(models["a"]), "--adapter", f"sql={models['sql']}")) as (url, _):
        return answer(complete(url, "sql"))[1], answer(complete(url, "base"))[1]


def add(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + "/v1/adapters", json=body, headers=headers, timeout=120)


def remove(url: str, adapter_id: str) -> httpx.Response:
    return httpx.delete(f"{url}/v1/adapters/{adapter_id}", timeout=60)


def error(reply: httpx.Response) -> tuple[int, str | None, str]:
    body = reply.json()["error"]
    return reply.status_code, body["param"], body["message"]


def test_an_adapter_a_client_adds_to_a_model_not_loaded_answers_as_on_its_one_model_server_across_reloads(
        models: dict[str, Path], alone: tuple[str, str], tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--ssd-cache", str(tmp_path / "kv"), "--generation-checkpoint", "0",
                                      *two_models(models, "--max-models", "1", "--adapter-dir", str(models["sql"].parent))])
    with serving(args) as (url, _):
        before = states(url)
        added = add(url, {"name": "sql", "path": str(models["sql"]), "model": "a"}).json()
        first = answer(complete(url, "a:sql"))
        listed = states(url)
        answer(complete(url, "b"))  # --max-models 1: `a` unloads
        unloaded = states(url)
        again, base = answer(complete(url, "a:sql")), answer(complete(url, "a"))
        removed = remove(url, "a:sql")
        gone, twice = complete(url, "a:sql"), remove(url, "a:sql")
    assert before == {"a": "unloaded", "b": "unloaded"}
    assert (added["id"], added["model"], added["name"], added["path"]) == ("a:sql", "a", "sql", str(models["sql"].resolve()))
    assert listed == {"a": "loaded", "a:sql": "loaded", "b": "unloaded"}  # `a` loaded to check the adapter
    assert unloaded == {"a": "unloaded", "a:sql": "unloaded", "b": "loaded"}
    # re-applied when `a` loaded again, its prompt's KV back from the SSD under its namespace (all but
    # the last of 135 tokens), none of it for the base model
    assert (first, again, base) == (("a", alone[0], 0), ("a", alone[0], 134), ("a", alone[1], 0))
    assert removed.status_code == 200 and removed.json() == {"id": "a:sql", "object": "adapter", "deleted": True}
    assert error(gone) == (404, "model", "no adapter named 'sql' is loaded (in 'model'); loaded: none")
    assert error(twice) == (404, "name", "no adapter named 'a:sql' is loaded")


def test_removing_an_adapter_from_a_model_not_loaded_does_not_load_it_and_its_reload_goes_without(
        models: dict[str, Path], alone: tuple[str, str]) -> None:
    with serving(serve_args(*two_models(models, "--max-models", "1", "--default-model", "a",
                                        "--adapter", f"a:sql={models['sql']}"))) as (url, _):
        bound = answer(complete(url, "a:sql"))
        answer(complete(url, "b"))  # `a` unloads
        removed = remove(url, "sql")  # a bare name: --default-model's
        after = states(url)
        gone = complete(url, "a:sql")
    assert bound == ("a", alone[0], 0) and removed.json()["id"] == "a:sql"
    assert after == {"a": "unloaded", "b": "loaded"}
    assert error(gone) == (404, "model", "no adapter named 'sql' is loaded (in 'model'); loaded: none")


def test_a_bad_adapter_request_is_a_4xx_and_loads_no_model_it_need_not(models: dict[str, Path], tmp_path: Path) -> None:
    root = models["sql"].parent
    outside = tmp_path / "outside"
    shutil.copytree(models["sql"], outside)
    broken = root / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "adapter_config.json").write_text('{"lora_parameters": {"scale": 2.0}}')
    (broken / "adapters.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    sql = str(models["sql"])
    with serving(serve_args(*two_models(models, "--adapter-dir", str(root), "--adapter", f"a:sql={sql}"))) as (url, _):
        replies = {
            "unknown model": add(url, {"name": "x", "path": sql, "model": "c"}),
            "no model": add(url, {"name": "x", "path": sql}),
            "model not a string": add(url, {"name": "x", "path": sql, "model": 3}),
            "outside": add(url, {"name": "x", "path": str(outside), "model": "b"}),
            "broken": add(url, {"name": "x", "path": str(broken), "model": "b"}),
            "taken": add(url, {"name": "sql", "path": sql, "model": "a"}),
            "bad name": add(url, {"name": "no/slash", "path": sql, "model": "b"}),
            "delete, no model": remove(url, "sql"),
            "delete, unknown model": remove(url, "c:sql"),
        }
        unloaded = states(url)
        mismatch = add(url, {"name": "o", "path": str(models["other"]), "model": "b"})
        served = complete(url, "b")
        listed = states(url)
    names = "'a', 'b'"
    assert {case: error(reply)[:2] for case, reply in replies.items()} == {
        "unknown model": (404, "model"), "no model": (404, "model"), "model not a string": (400, "model"),
        "outside": (403, "path"), "broken": (400, "path"), "taken": (400, "path"), "bad name": (400, "path"),
        "delete, no model": (404, "model"), "delete, unknown model": (404, "model")}
    assert error(replies["unknown model"])[2] == f"the model 'c' does not exist; this server serves {names}"
    assert error(replies["no model"])[2] == ("say which model the adapter is for ('model' in the body, or DELETE "
                                             f"/v1/adapters/MODEL:NAME): one of {names} (there is no --default-model)")
    assert "is not a readable safetensors file (the header is not JSON" in error(replies["broken"])[2]
    assert error(replies["taken"])[2] == f"the model 'a' already has an adapter named 'sql' (from {models['sql']})"
    assert unloaded == {"a": "unloaded", "a:sql": "unloaded", "b": "unloaded"}  # no bad request loaded a model
    status, param, message = error(mismatch)
    assert (status, param) == (400, "path")
    assert message.startswith(f"model 'b': adapter {models['other'].resolve()} (trained on tiny-other) does not fit model ")
    assert served.status_code == 200 and listed == {"a": "unloaded", "a:sql": "unloaded", "b": "loaded"}


def test_adding_an_adapter_to_one_of_several_models_needs_the_api_key(models: dict[str, Path]) -> None:
    args = serve_args(*two_models(models, "--adapter-dir", str(models["sql"].parent)))
    engine, vocab_size, _ = load_engine(args)
    body = {"name": "sql", "path": str(models["sql"]), "model": "a"}
    try:
        with running(build_app(engine, ServeConfig(vocab_size=vocab_size, api_key="k"))) as url:
            refused = add(url, body)
            added = add(url, body, authorization="Bearer k")
    finally:
        engine.close(30)
    assert refused.status_code == 401 and added.status_code == 200
