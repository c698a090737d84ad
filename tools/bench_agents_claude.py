"""A scripted 5-turn Claude Code session (`claude -p`, then `--continue`) against `mlxkv serve` on
the agent model, with the billing-header handling on (the default) and off (`--keep-billing-header`).
Per turn, from the server's metrics: prompt tokens, cached tokens and the server's time to first token.

    uv run python -m tools.bench_agents_claude

Targets: turns 2-5 reuse >= 95% of the prompt; their TTFT <= 1/10 of turn 1's. Turn 6 is a new
session in the same directory: it shows what leaving the billing header out buys.
Needs Claude Code installed: `npm ci --prefix tests`.
"""

from __future__ import annotations

import platform
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.agent_model import write_agent_model
from tests.claude_cli import claude_turn
from tests.server_process import ServerProcess

PROMPTS = ["Say hello", "What is two plus two?", "Name a colour", "Say goodbye", "Thanks"]
# Turn 6 starts a new session (no --continue): its billing header differs from the first session's
# (the suffix follows the first message), so only with the header left out does it reuse the
# system prompt and tools the first session cached.
NEW_SESSION = "Write a haiku"
_METRIC = re.compile(r"^(mlxkv_[\w]+(?:_total|_sum)) (\S+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def claude_session(billing_header: bool, model: Path | None = None) -> list[Turn]:
    """The 5 turns (and a 6th, a new session) with the billing-header handling on (`billing_header`: the block is left out,
    the default) or off. Writes the agent model to a temporary directory unless given `model`."""
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-claude-") as tmp:
        root = Path(tmp)
        model = model or write_agent_model(root / "model")
        server = ServerProcess(root / "ssd", "--model", str(model), *([] if billing_header else ["--keep-billing-header"]))
        workdir = root / "work"
        workdir.mkdir()
        try:
            turns = []
            for i, prompt in enumerate([*PROMPTS, NEW_SESSION]):
                before = _counters(server.url)
                done = claude_turn(server.url, workdir, prompt, resume=0 < i < len(PROMPTS))
                if done.returncode != 0:
                    raise RuntimeError(f"claude exited {done.returncode}: {done.stderr}")
                after = _counters(server.url)
                turns.append(Turn(int(_diff(before, after, "mlxkv_prompt_tokens_total")),
                                  int(_diff(before, after, "mlxkv_cached_prompt_tokens_total")),
                                  _diff(before, after, "mlxkv_time_to_first_token_seconds_sum")))
            return turns
        finally:
            server.stop()


def _counters(url: str) -> dict[str, float]:
    return {name: float(value) for name, value in _METRIC.findall(httpx.get(url + "/metrics", timeout=10).text)}


def _diff(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def print_session(title: str, turns: list[Turn]) -> None:
    print(title)
    print(f"  {'turn':>4} | {'prompt':>7} | {'cached':>7} | {'reuse':>6} | {'TTFT s':>7} | {'TTFT / turn 1':>13}")
    for i, turn in enumerate(turns, start=1):
        if i == len(PROMPTS) + 1:
            print("  (a new session:)")
        ratio = turn.ttft_s / turns[0].ttft_s if turns[0].ttft_s else 0.0
        print(f"  {i:>4} | {turn.prompt_tokens:>7} | {turn.cached_tokens:>7} | {turn.reuse:>6.1%} | {turn.ttft_s:>7.3f} | {ratio:>13.3f}")
    later = turns[1:len(PROMPTS)]
    reuse_ok = all(t.reuse >= 0.95 for t in later)
    ttft_ok = all(t.ttft_s <= turns[0].ttft_s / 10 for t in later)
    print(f"  turns 2-5: reuse >= 95%: {'yes' if reuse_ok else 'no'}; TTFT <= 1/10 of turn 1's: {'yes' if ttft_ok else 'no'}")


def main() -> None:
    print(f"CPU: {platform.processor() or platform.machine()} ({_cpu_model()})")
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-model-") as tmp:
        model = write_agent_model(Path(tmp) / "model")
        print_session("Claude Code, billing header left out (default):", claude_session(True, model))
        print_session("Claude Code, --keep-billing-header:", claude_session(False, model))


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1) if found else "unknown"


if __name__ == "__main__":
    main()
