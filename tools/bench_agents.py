"""Agent sessions against a real `mlxkv serve` on the tiny agent model (tests/agent_model.py):
per turn, prompt tokens, cached tokens and time to first token, read from the server's /metrics.

- `codex_session`: `codex exec`, then `codex exec resume --last` four times (Codex sends the whole
  history each turn, `store: false`). Targets: turns 2-5 reuse >= 95% of their prompt; their TTFT
  <= 1/10 of turn 1's.
- `responses_restart`: a stored response, a server restart, then a continuation by
  `previous_response_id` with only the new item. Target: it reuses >= 95% of its prompt (its
  latency is the request's, restore from the SSD included, and has no target).
- `claude_session`: `claude -p`, then `claude -p --continue` four times, then turn 6, a new session
  in the same directory. Targets as Codex's for turns 2-5. Run once with Claude Code's billing
  header left out of the prompt (the default) and once with `--keep-billing-header` (no targets:
  it shows what a new session loses when the header stays).

Sessions for other clients add their own function and register it in `SESSIONS`.

    uv run python -m tools.bench_agents          # needs `npm ci --prefix tests` for the CLIs
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.agent_model import write_agent_model
from tests.claude_cli import claude_turn
from tests.server_process import ServerProcess

CODEX = Path(__file__).resolve().parent.parent / "tests" / "node_modules" / ".bin" / "codex"
TURNS = ("Say hello", "Say it again", "Count to three", "Name a colour", "Say goodbye")
RULES = "\n".join(f"Rule {i}: keep answers short and cite the rule you follow." for i in range(600))
PROJECT_NOTES = "# Project notes\n" + "\n".join(
    f"- Module {i}: handlers validate input, map errors to 4xx, and log one line per request." for i in range(1200))
MIN_REUSE, MAX_TTFT_RATIO = 0.95, 0.1


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # the server's (0 when the answer was empty: no first token)
    wall_s: float  # the client's, whole request

    @property
    def latency_s(self) -> float:
        return self.ttft_s or self.wall_s

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def counters(url: str) -> tuple[float, float, float]:
    """(prompt tokens, cached prompt tokens, summed time to first token) so far."""
    text = httpx.get(url + "/metrics", timeout=10).text
    names = ("mlxkv_prompt_tokens_total", "mlxkv_cached_prompt_tokens_total", "mlxkv_time_to_first_token_seconds_sum")
    values = {m[1]: float(m[2]) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}
    return values[names[0]], values[names[1]], values[names[2]]


def measured(url: str, action: Callable[[], object]) -> Turn:
    before, start = counters(url), time.perf_counter()
    action()
    wall, after = time.perf_counter() - start, counters(url)
    return Turn(int(after[0] - before[0]), int(after[1] - before[1]), after[2] - before[2], wall)


def codex_session(model: Path, work: Path) -> list[Turn]:
    server = ServerProcess(work / "codex-ssd", "--model", str(model))
    home, cwd = work / "codex-home", work / "codex-work"
    home.mkdir()
    cwd.mkdir()
    (cwd / "AGENTS.md").write_text(PROJECT_NOTES)  # Codex puts it in the prompt, as a real project's would be
    (home / "config.toml").write_text(
        'model = "agent"\nmodel_provider = "mlxkv"\n[model_providers.mlxkv]\nname = "mlxkv"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\nenv_key = "OPENAI_API_KEY"\n'
        "request_max_retries = 0\nstream_max_retries = 0\n")
    env = {**os.environ, "CODEX_HOME": str(home), "OPENAI_API_KEY": "unused"}

    def codex(*args: str) -> Callable[[], object]:
        return lambda: subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", *args], cwd=cwd, env=env, check=True,
                                      stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
    try:
        turns = [measured(server.url, codex(TURNS[0]))]
        turns += [measured(server.url, codex("resume", "--last", text)) for text in TURNS[1:]]
    finally:
        server.stop()
    return turns


def responses_restart(model: Path, work: Path) -> list[Turn]:
    ssd = work / "responses-ssd"
    first: dict[str, str] = {}

    def create(url: str, **fields: object) -> Callable[[], None]:
        def run() -> None:
            got = httpx.post(url + "/v1/responses", json={"instructions": RULES, "max_output_tokens": 8, **fields}, timeout=600)
            got.raise_for_status()
            first.setdefault("id", got.json()["id"])
        return run

    server = ServerProcess(ssd, "--model", str(model))
    try:
        turns = [measured(server.url, create(server.url, input="Hello"))]
        httpx.post(server.url + "/admin/cache/flush", timeout=120).raise_for_status()
    finally:
        server.stop()
    server = ServerProcess(ssd, "--model", str(model))
    try:
        turns.append(measured(server.url, create(server.url, input="Again", previous_response_id=first["id"])))
    finally:
        server.stop()
    return turns


def claude_session(model: Path, work: Path, keep_billing_header: bool = False) -> list[Turn]:
    flags = ["--keep-billing-header"] if keep_billing_header else []
    root = work / ("claude-kept" if keep_billing_header else "claude")
    cwd = root / "work"
    cwd.mkdir(parents=True)
    server = ServerProcess(root / "ssd", "--model", str(model), *flags)

    def claude(prompt: str, resume: bool) -> Callable[[], object]:
        def run() -> None:
            done = claude_turn(server.url, cwd, prompt, resume=resume)
            if done.returncode != 0:
                raise RuntimeError(f"claude exited {done.returncode}: {done.stderr}")
        return run
    try:
        turns = [measured(server.url, claude(text, resume=i > 0)) for i, text in enumerate(TURNS)]
        # A new session: its billing header differs from the first session's (the suffix follows the
        # first message), so only with the header left out does it reuse the cached system prompt and tools.
        turns.append(measured(server.url, claude("Write a haiku", resume=False)))
    finally:
        server.stop()
    return turns


@dataclass(frozen=True, slots=True)
class Session:
    run: Callable[[Path, Path], list[Turn]]
    ttft_target: bool = True  # turns 2+ must also start within 1/10 of turn 1's time
    targeted: int | None = None  # how many turns the targets cover (None: all); 0: report only
    note: str = ""


SESSIONS: dict[str, Session] = {
    "codex (exec, then exec resume --last)": Session(codex_session),
    "responses: previous_response_id after a restart": Session(responses_restart, ttft_target=False),
    "claude code (-p, then -p --continue)": Session(claude_session, targeted=len(TURNS), note="turn 6: a new session"),
    "claude code, --keep-billing-header": Session(lambda model, work: claude_session(model, work, keep_billing_header=True),
                                                  targeted=0, note="turn 6: a new session"),
}


def report(name: str, turns: list[Turn], session: Session) -> bool:
    print(f"\n{name}" + (f" ({session.note})" if session.note else ""))
    print("turn  prompt  cached  reuse   TTFT s  request s  latency / turn 1  (latency: TTFT, or the request's time when empty)")
    for i, turn in enumerate(turns, 1):
        ratio = turn.latency_s / turns[0].latency_s
        print(f"{i:>4}  {turn.prompt_tokens:>6}  {turn.cached_tokens:>6}  {turn.reuse:>5.1%}  {turn.ttft_s:>6.3f}  "
              f"{turn.wall_s:>9.3f}  {ratio:>8.3f}")
    if session.targeted == 0:
        return True
    later = turns[1:session.targeted]
    reuse_ok = all(t.reuse >= MIN_REUSE for t in later)
    ttft_ok = all(t.latency_s <= MAX_TTFT_RATIO * turns[0].latency_s for t in later)
    covered = "none" if not later else "2" if len(later) == 1 else f"2-{len(later) + 1}"
    print(f"targets: turns {covered} reuse >= {MIN_REUSE:.0%}: {'met' if reuse_ok else 'MISSED'}" +
          (f"; latency <= {MAX_TTFT_RATIO:g} x turn 1: {'met' if ttft_ok else 'MISSED'}" if session.ttft_target else ""))
    return reuse_ok and (ttft_ok or not session.ttft_target)


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"model name\s*:\s*(.*)", info)
    isa = "AVX-512" if " avx512f" in info else "AVX2" if " avx2" in info else "no AVX2"
    return f"{name[1] if name else platform.processor()} ({isa}), {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(SESSIONS), action="append", help="run this session (repeatable; default: all)")
    args = parser.parse_args()
    print(f"CPU: {cpu()}")
    with tempfile.TemporaryDirectory(prefix="bench-agents-") as tmp:
        work = Path(tmp)
        model = write_agent_model(work / "model")
        results = [report(name, session.run(model, work), session) for name, session in SESSIONS.items()
                   if not args.only or name in args.only]
    raise SystemExit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
