"""Real OpenAI-side agent clients against a real `mlxkv serve` on the tiny agent model: Codex
(`codex exec`, then `codex exec resume --last`) and an OpenAI Agents SDK agent with one function
tool, two turns each. These pin the protocol and the prompt cache, not what the model says: each
client exits cleanly and its second turn reuses at least 95% of its prompt from the cache."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agent_model import write_agent_model
from tests.server_process import ServerProcess

CODEX = Path(__file__).parent / "node_modules" / ".bin" / "codex"
CLIENT_TIMEOUT_S = 240
MIN_REUSE = 0.95


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = write_agent_model(tmp_path_factory.mktemp("agent") / "model")
    server = ServerProcess(tmp_path_factory.mktemp("agent-serve") / "ssd", "--model", str(model), "--log-level", "info")
    yield server
    server.stop()


def prompt_counters(url: str) -> tuple[float, float]:
    """(prompt tokens, of them cached) the server has seen so far."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = {m[1]: float(m[2]) for m in re.finditer(r"^mlxkv_(prompt|cached_prompt)_tokens_total (\S+)$", text, re.M)}
    return found["prompt"], found["cached_prompt"]


def server_errors(server: ServerProcess) -> list[str]:
    return [line for line in server.log.read_text().splitlines() if re.search(r'" 5\d\d |Traceback|ERROR', line)]


def codex_home(directory: Path, url: str) -> Path:
    """A CODEX_HOME whose provider is the server (Responses API), retries off: a failed stream fails the run."""
    directory.mkdir()
    (directory / "config.toml").write_text(
        'model = "agent"\nmodel_provider = "mlxkv"\n\n[model_providers.mlxkv]\nname = "mlxkv"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "OPENAI_API_KEY"\n'
        "request_max_retries = 0\nstream_max_retries = 0\n")
    return directory


def run_codex(home: Path, workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CODEX.exists(), f"{CODEX} is missing: run `npm ci --prefix tests`"
    env = {**os.environ, "CODEX_HOME": str(home), "OPENAI_API_KEY": "unused"}
    return subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", *args], cwd=workdir, env=env, text=True,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=CLIENT_TIMEOUT_S)


def test_codex_exec_and_resume_reuse_the_prompt_cache(agent_server: ServerProcess, tmp_path: Path) -> None:
    home, work = codex_home(tmp_path / "codex-home", agent_server.url), tmp_path / "work"
    work.mkdir()
    turns = []
    for args in (("Say hello",), ("resume", "--last", "Say it again")):
        before = prompt_counters(agent_server.url)
        done = run_codex(home, work, *args)
        assert done.returncode == 0, f"codex {args} failed:\n{done.stderr[-3000:]}\nserver:\n{server_errors(agent_server)}"
        after = prompt_counters(agent_server.url)
        turns.append((after[0] - before[0], after[1] - before[1]))
    assert server_errors(agent_server) == []
    (first_prompt, _), (second_prompt, second_cached) = turns
    assert first_prompt > 5000  # Codex's instructions and tools: the prompt is long
    assert second_prompt > first_prompt and second_cached / second_prompt >= MIN_REUSE


def test_agents_sdk_two_turns_by_previous_response_id_reuse_the_cache(agent_server: ServerProcess) -> None:
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no export to OpenAI's tracing service

    @function_tool
    def local_time(city: str) -> str:
        """The local time in a city."""
        return f"noon in {city}"

    client = AsyncOpenAI(base_url=agent_server.url + "/v1", api_key="unused", max_retries=0)
    # Long instructions, as an agent's are: the new turn is a small part of the second prompt.
    rules = "\n".join(f"Rule {i}: answer politely and check the clock tool before giving any time." for i in range(200))
    agent = Agent(name="clock", instructions=rules, tools=[local_time],
                  model=OpenAIResponsesModel(model="agent", openai_client=client))
    before = prompt_counters(agent_server.url)
    first = Runner.run_sync(agent, "What time is it in Paris?")
    middle = prompt_counters(agent_server.url)
    second = Runner.run_sync(agent, "And in Rome?", previous_response_id=first.last_response_id)
    after = prompt_counters(agent_server.url)
    assert first.last_response_id is not None and second.last_response_id not in (None, first.last_response_id)
    assert isinstance(second.final_output, str)
    first_prompt = middle[0] - before[0]
    second_prompt, second_cached = after[0] - middle[0], after[1] - middle[1]
    assert first_prompt > 2000 and second_prompt > first_prompt
    assert second_cached / second_prompt >= MIN_REUSE
    assert server_errors(agent_server) == []


def test_stored_response_continues_after_a_restart_from_the_cache(tmp_path: Path) -> None:
    model = write_agent_model(tmp_path / "model")
    ssd = tmp_path / "ssd"
    rules = "\n".join(f"Rule {i}: keep answers short and cite the rule you follow." for i in range(150))
    server = ServerProcess(ssd, "--model", str(model))
    try:
        first = httpx.post(server.url + "/v1/responses", timeout=120,
                           json={"instructions": rules, "input": "Hello", "max_output_tokens": 8}).json()
        assert httpx.post(server.url + "/admin/cache/flush", timeout=60).status_code == 200
    finally:
        server.stop()
    server = ServerProcess(ssd, "--model", str(model))
    try:
        got = httpx.post(server.url + "/v1/responses", timeout=120,
                         json={"previous_response_id": first["id"], "instructions": rules, "input": "Again",
                               "max_output_tokens": 8})
        assert got.status_code == 200, got.text
        usage = got.json()["usage"]
        assert usage["input_tokens"] > first["usage"]["input_tokens"] > 1500
        assert usage["input_tokens_details"]["cached_tokens"] / usage["input_tokens"] >= MIN_REUSE
        assert httpx.get(f"{server.url}/v1/responses/{first['id']}").json()["output"] == first["output"]
    finally:
        server.stop()
