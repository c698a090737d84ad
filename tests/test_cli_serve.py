"""`mlxkv serve`'s command line reaches the engine it builds, and bad settings stop it before the model loads."""

from __future__ import annotations

import httpx
import pytest

from mlxkv.cli import build_parser, main
from mlxkv.commands.serve import build_engine
from mlxkv_inference import GenerationParams
from mlxkv_serve import ServeConfig, build_app
from tests.bindings import RecordingBinding
from tests.factories import TINY_VOCAB, make_tiny_binding
from tests.serving import running

# 100 byte tokens with the tiny byte tokenizer, no EOS within 4 tokens: longer than a prompt whose
# rest rides in a decode step without a prefill chunk of its own (`Generation.join`)
PROMPT = "hello there friends!" * 5


def serve_once(*flags: str) -> tuple[RecordingBinding, int, GenerationParams, int]:
    """Build the engine as `mlxkv serve FLAGS` does (over a tiny model), answer one completion;
    returns the binding, its compiled decode steps (before the engine's close drops them), the
    engine's base parameters and its queue bound."""
    args = build_parser().parse_args(["serve", "--no-ssd-cache", *flags])
    binding = make_tiny_binding("llama", binding_class=RecordingBinding)
    assert isinstance(binding, RecordingBinding)
    binding.chunks = []
    engine = build_engine(args, binding)
    try:
        with running(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB))) as url:
            # No speculation: a round of drafts (the repetitive prompt has n-gram matches) traces a
            # compiled step of its own positions, besides the plain one these tests count.
            reply = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "speculative": {"mode": "off"}},
                               timeout=60)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
            traces = binding.compiled_traces
    finally:
        engine.close(30)
    return binding, traces, engine.base_params, engine.max_queue


def test_serve_flags_reach_the_engine() -> None:
    binding, traces, params, max_queue = serve_once("--no-compiled-decode", "--prefill-step-size", "7", "--max-queue", "3")
    assert (params.compiled_decode, params.prefill_chunk, max_queue) == (False, 7, 3)
    assert set(binding.chunks) == {7} and traces == 0  # every step ran through the ordinary graph


def test_serve_defaults_compile_the_decode_step() -> None:
    binding, traces, params, max_queue = serve_once()
    assert (params.compiled_decode, params.prefill_chunk, max_queue) == (True, 64, 16)
    assert set(binding.chunks) == {64} and traces == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "  "], "--api-key is empty"),
    (["--max-queue", "0"], "--max-queue=0 must be >= 1"),
    (["--max-connections", "0"], "--max-connections=0 must be >= 1"),
    (["--request-timeout", "0"], "--request-timeout=0.0 must be > 0"),
    (["--prefill-step-size", "0"], "--prefill-step-size=0 must be >= 1"),
    (["--remote-cache", "redis://127.0.0.1:1/0", "--no-ssd-cache"], "--remote-cache sits under the SSD cache"),
    (["--remote-cache-hmac-key-file", "/dev/null"], "give --remote-cache too"),
    (["--remote-cache", "http://example.com/x"], "give redis://host:port"),
    (["--remote-cache", "s3://bucket/p?colour=blue"], "unknown option(s) ['colour']"),
    (["--remote-cache", "redis://127.0.0.1:1/0", "--remote-cache-hmac-key-file", "/nonexistent/key"], "cannot be read"),
])
def test_bad_serve_settings_are_refused_at_start_up(capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    assert main(["serve", "--model", "/nonexistent/model", *flags]) == 2
    assert message in capsys.readouterr().err
