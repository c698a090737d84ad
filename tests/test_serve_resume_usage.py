"""Usage of a resumed generation describes its prompt: the tokens restored from a checkpoint are
`resumed_tokens`, never cached prompt tokens (which cannot exceed the prompt)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from mlxkv.engine.cache_services import build_tiers
from mlxkv.engine.local_engine import LocalEngine
from mlxkv_inference import GenerationParams
from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.tokenizer.chat import encode_chat
from mlxkv_serve import ServeConfig, build_app
from tests.bindings import FailingBinding
from tests.factories import TINY_VOCAB, make_tiny_binding
from tests.serving import running

MESSAGES = [{"role": "user", "content": "Once upon a time"}]
MAX_TOKENS = 24  # the tiny model reaches no EOS within these (checked)


def test_resumed_generation_reports_prompt_usage_and_resumed_tokens_apart(tmp_path: Path) -> None:
    binding = make_tiny_binding("llama", binding_class=FailingBinding)
    assert isinstance(binding, FailingBinding)
    binding.decodes_left = 10  # the first run fails after its checkpoints at 4 and 8 tokens
    tiers, cold = build_tiers(binding, ram_bytes=1 << 30, ssd_dir=tmp_path / "ssd", ssd_bytes=1 << 30)
    assert cold is not None
    engine = LocalEngine(binding, tiers, ssd=cold, checkpoint_every=4)
    body: dict[str, Any] = {"messages": MESSAGES, "max_tokens": MAX_TOKENS}
    try:
        with running(build_app(engine, ServeConfig(vocab_size=TINY_VOCAB))) as url:
            failed = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert failed.status_code == 500
            assert engine.flush(30).durable  # the checkpoints are durable
            binding.decodes_left = 10**6
            first_state = httpx.get(f"{url}/v1/generations/{failed.headers['x-mlxkv-generation-id']}").json()
            openai_reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
            anthropic_reply = httpx.post(url + "/v1/messages", json=body, timeout=60).json()
    finally:
        engine.close(30)
    prompt = encode_chat(binding.tokenizer, MESSAGES).tokens
    expected = Generation(binding, prompt, GenerationParams(max_tokens=MAX_TOKENS)).run().text
    resumed = first_state["checkpointed_tokens"]
    assert resumed == 8
    usage = openai_reply["usage"]
    assert openai_reply["choices"][0]["message"]["content"] == expected
    assert usage["prompt_tokens"] == len(prompt) and usage["prompt_tokens_details"]["cached_tokens"] == len(prompt)
    assert usage["resumed_tokens"] == resumed and usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == len(prompt) + MAX_TOKENS
    anthropic_usage = anthropic_reply["usage"]
    assert anthropic_reply["content"][0]["text"] == expected
    assert anthropic_usage["input_tokens"] + anthropic_usage["cache_read_input_tokens"] == len(prompt)
    assert anthropic_usage["input_tokens"] >= 0 and anthropic_usage["output_tokens"] == MAX_TOKENS
