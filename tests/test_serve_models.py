"""Several models behind one server (`mlxkv serve --model A --model B ...`): the request's `model`
picks one, models load on demand and unload least recently used first, and an unloaded model's
SSD KV serves it again after it reloads."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxkv.cli import build_parser
from mlxkv.commands.options import runtime_info
from mlxkv.commands.serve import build_engine, load_engine
from mlxkv.engine.measured import PROCESS_MEMORY, MemoryGauge
from mlxkv.engine.model_sources import parse_model_specs
from mlxkv.engine.models import ModelSpec
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_serve import ServeConfig, ServeEngine, build_app
from tests.factories import make_tiny_binding
from tests.gauges import FedGauge, reading_mib
from tests.serving import running
from tests.factories import save_mlx_lm_directory

PROMPT = "the quick brown fox jumps over the lazy dog, " * 3
EMBEDDED = "SmolLM2-135M-Instruct-Q4_1"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dirs = {"llama": root / "tiny-llama", "qwen": root / "tiny-qwen3"}
    save_mlx_lm_directory(make_tiny_binding("llama", seed=3), dirs["llama"])
    save_mlx_lm_directory(make_tiny_binding("qwen3", seed=5), dirs["qwen"])
    return dirs


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--no-ssd-cache", "--generation-checkpoint", "0", *flags])


@contextmanager
def serving(args: argparse.Namespace, binding: MlxAutoregressiveBinding | None = None,
            gauge: MemoryGauge = PROCESS_MEMORY) -> Iterator[tuple[str, ServeEngine]]:
    """`mlxkv serve ARGS` in this process (`binding`: the one model, already loaded; `gauge`:
    what the memory budget reads of the process)."""
    if binding is None:
        engine, vocab_size, runtime = load_engine(args, gauge)
    else:
        engine, vocab_size, runtime = build_engine(args, binding), binding.tokenizer.vocab_size, runtime_info(binding)
    try:
        with running(build_app(engine, ServeConfig(vocab_size=vocab_size, cpu_kernels=runtime["cpu_kernels"], blas=runtime["blas"]))) as url:
            yield url, engine
    finally:
        engine.close(30)


def complete(url: str, model: str, prompt: str = PROMPT, **extra: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                    "speculative": {"mode": "off"}, **extra}, timeout=120)


def answer(reply: httpx.Response) -> tuple[str, str, int]:
    """(model, text, cached tokens) of a 200 completion."""
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["model"], body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(url + "/v1/models").json()["data"]}


def test_three_models_two_loaded_answer_as_each_alone_and_a_reloaded_model_hits_its_ssd_kv_embedded(
    model_dirs: dict[str, Path], embedded_native: MlxAutoregressiveBinding, tmp_path: Path
) -> None:
    alone = {}
    for name, source in (("llama", str(model_dirs["llama"])), ("qwen", str(model_dirs["qwen"])), (EMBEDDED, "embedded")):
        binding = embedded_native if source == "embedded" else None  # loaded once for the session
        with serving(serve_args("--model", source), binding) as (url, _):
            alone[name] = answer(complete(url, "any-name-at-all"))[1]  # one model serves every name
    # the embedded model is pinned (loaded once: its batch probe takes seconds); the two tiny ones
    # share the other place, each unloaded by the other and reloaded
    args = build_parser().parse_args([
        "serve", "--ssd-cache", str(tmp_path / "kv"), "--generation-checkpoint", "0", "--max-models", "2",
        "--model", f"llama={model_dirs['llama']}", "--model", f"qwen={model_dirs['qwen']}", "--model", "embedded",
        "--pin", EMBEDDED])
    order = ("llama", EMBEDDED, "qwen", EMBEDDED) * 2
    with serving(args) as (url, _):
        assert states(url) == {"llama": "unloaded", "qwen": "unloaded", EMBEDDED: "loaded"}
        seen = [answer(complete(url, name)) for name in order]
        assert states(url) == {"llama": "unloaded", "qwen": "loaded", EMBEDDED: "loaded"}
    assert [(model, text) for model, text, _ in seen] == [(n, alone[n]) for n in order]
    # each tiny model was unloaded (two loaded at most) and reloaded: its prompt's KV came back from
    # the SSD (135 byte tokens, all but the last reused); the pinned model's came from RAM (31 tokens)
    assert [c for _, _, c in seen] == [0, 0, 0, 30, 134, 30, 134, 30]


def test_an_unknown_model_is_a_404_in_each_apis_shape_and_the_default_model_takes_it(model_dirs: dict[str, Path]) -> None:
    flags = ("--model", f"a={model_dirs['llama']}", "--model", f"b={model_dirs['qwen']}")
    with serving(serve_args(*flags)) as (url, _):
        openai = complete(url, "gpt-4o")
        anthropic = httpx.post(url + "/v1/messages", json={"model": "claude-x", "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        responses = httpx.post(url + "/v1/responses", json={"model": "gpt-5", "input": "hi"}, timeout=60)
        retrieved = httpx.get(url + "/v1/models/gpt-4o")
        assert states(url) == {"a": "unloaded", "b": "unloaded"}  # nothing loaded for a request nobody serves
    message = "the model 'gpt-4o' does not exist; this server serves 'a', 'b'"
    assert (openai.status_code, openai.json()["error"]) == (404, {"message": message, "type": "not_found_error",
                                                                   "param": "model", "code": "model_not_found"})
    assert (anthropic.status_code, anthropic.json()) == (404, {"type": "error", "error": {
        "type": "not_found_error", "message": "the model 'claude-x' does not exist; this server serves 'a', 'b'"}})
    assert (responses.status_code, responses.json()["error"]["code"]) == (404, "model_not_found")
    assert retrieved.status_code == 404
    with serving(serve_args(*flags, "--default-model", "b")) as (url, _):
        assert answer(complete(url, "gpt-4o"))[0] == "b"


def test_a_model_that_fails_to_load_is_a_503_and_the_others_keep_serving(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    with serving(serve_args("--model", f"good={model_dirs['llama']}", "--model", f"broken={broken}")) as (url, _):
        first = answer(complete(url, "good"))
        failed = complete(url, "broken")
        again = answer(complete(url, "good"))
        listed = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "model_unavailable"
    assert failed.json()["error"]["message"].startswith("the model 'broken' failed to load: ")
    assert first[1] == again[1]
    assert listed["good"]["state"] == "loaded" and listed["broken"]["state"] == "failed" and "error" in listed["broken"]


def test_a_budget_too_small_for_any_model_refuses_the_load_with_the_numbers(model_dirs: dict[str, Path]) -> None:
    with serving(serve_args("--model", f"a={model_dirs['llama']}", "--model", f"b={model_dirs['qwen']}",
                            "--memory-budget", "64K", "--prompt-cache-bytes", "0")) as (url, _):
        refused = complete(url, "a")
    assert refused.status_code == 503
    message = refused.json()["error"]["message"]
    assert message.startswith("the model 'a' needs about ") and "the memory budget is 0.1 MiB (--memory-budget)" in message


def test_one_model_over_the_budget_stops_the_server_before_it_loads() -> None:
    with pytest.raises(ValueError, match=r"the model 'SmolLM2-135M-Instruct-Q4_1' needs about .* memory budget is 1.0 MiB"):
        load_engine(serve_args("--memory-budget", "1M"))


def test_a_request_whose_kv_could_never_fit_is_a_400_that_names_the_numbers(model_dirs: dict[str, Path]) -> None:
    # the tiny models' weights are ~0.1 MiB; 1 MiB leaves room for a few thousand tokens of their KV
    # (in a process the gauge says holds 0.1 MiB: this process holds far more than 1 MiB)
    with serving(serve_args("--model", f"a={model_dirs['llama']}", "--model", f"b={model_dirs['qwen']}",
                            "--memory-budget", "1M", "--prompt-cache-bytes", "0"), gauge=FedGauge(reading_mib(0.1))) as (url, _):
        small = complete(url, "a")
        large = complete(url, "a", max_tokens=100_000)
    assert small.status_code == 200
    assert large.status_code == 400
    message = large.json()["error"]["message"]
    assert message.startswith("the request plans ") and "passes the memory budget of 1.0 MiB (--memory-budget)" in message


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-models", "2"], "--max-models is for several models"),
    (["--pin", "x"], "--pin and --model-ttl are for several models"),
    (["--model", "a=embedded", "--model", "a=embedded"], "two models are named 'a'"),
    (["--model", "a=embedded", "--model", "b=embedded", "--pin", "c"], "model 'c' is not registered"),
    (["--model", "a=embedded", "--model", "b=embedded", "--max-models", "0"], "--max-models=0 must be >= 1"),
])
def test_bad_model_settings_stop_the_server_before_any_model_loads(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_engine(serve_args(*flags))


def test_a_pinned_model_that_fails_to_load_stops_the_server_with_the_reason(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"^pinned the model 'missing' failed to load: ModelLoadError: model path .* does not exist"):
        load_engine(serve_args("--model", f"a={model_dirs['llama']}", "--model", f"missing={tmp_path / 'nothing.gguf'}",
                               "--pin", "missing"))


def test_model_values_and_a_models_dir_name_each_model(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()  # no config.json: not a model
    gguf = tmp_path / "small.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    specs = parse_model_specs([f"fast={model_dirs['llama']}", "embedded", "org/some-model-4bit"], tmp_path)
    assert specs == [ModelSpec("fast", str(model_dirs["llama"])), ModelSpec(EMBEDDED, None),
                     ModelSpec("org/some-model-4bit", "org/some-model-4bit"), ModelSpec("small.Q4_0", str(gguf))]
    assert parse_model_specs([str(model_dirs["qwen"])], None) == [ModelSpec("tiny-qwen3", str(model_dirs["qwen"]))]
    with pytest.raises(ValueError, match="holds no model"):
        parse_model_specs([], tmp_path / "notes")
