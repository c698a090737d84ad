"""Claude Code (the real CLI, pinned in tests/package.json) against a real `mlxkv serve` on the
agent model: two turns, the second continuing the first, and the cache serving the second's prompt.
What the model answers is random; this pins the protocol and the cache."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agent_model import write_agent_model
from tests.claude_cli import CLAUDE, claude_turn
from tests.server_process import ServerProcess

pytestmark = pytest.mark.skipif(not CLAUDE.exists(), reason="Claude Code is not installed (npm ci --prefix tests)")


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("claude-code")
    model = write_agent_model(root / "model")
    server = ServerProcess(root / "ssd", "--model", str(model))
    try:
        yield server
    finally:
        server.stop()


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: float(value) for name, value in re.findall(r"^(mlxkv_\w+_total) (\S+)$", text, re.MULTILINE)}


def test_claude_code_continues_a_session_from_the_prompt_cache(agent_server: ServerProcess, tmp_path: Path) -> None:
    before = counters(agent_server.url)
    first = claude_turn(agent_server.url, tmp_path, "Say hello", resume=False)
    assert first.returncode == 0, first.stderr
    middle = counters(agent_server.url)
    second = claude_turn(agent_server.url, tmp_path, "Say it again", resume=True)
    assert second.returncode == 0, second.stderr
    after = counters(agent_server.url)

    first_prompt = middle["mlxkv_prompt_tokens_total"] - before["mlxkv_prompt_tokens_total"]
    second_prompt = after["mlxkv_prompt_tokens_total"] - middle["mlxkv_prompt_tokens_total"]
    second_cached = after["mlxkv_cached_prompt_tokens_total"] - middle["mlxkv_cached_prompt_tokens_total"]
    assert first_prompt > 5000  # Claude Code's system prompt and tools, whole
    assert second_prompt > first_prompt
    assert second_cached >= 0.95 * second_prompt
    # One request a turn, each with its billing header left out of the prompt.
    assert after["mlxkv_billing_headers_dropped_total"] - before["mlxkv_billing_headers_dropped_total"] == 2
