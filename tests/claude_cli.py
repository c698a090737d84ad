"""Running the pinned Claude Code CLI (`tests/node_modules`, from `npm ci --prefix tests`) against
a local server, offline, with its own home directory (its sessions, for `--continue`, live there)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

CLAUDE = Path(__file__).parent / "node_modules" / ".bin" / "claude"
TURN_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class ClaudeTurn:
    returncode: int
    stdout: str
    stderr: str


def claude_turn(url: str, workdir: Path, prompt: str, *, resume: bool) -> ClaudeTurn:
    """`claude -p PROMPT` (with `--continue` when `resume`) in `workdir`, its HOME under it."""
    home = workdir / ".home"
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "x",
           "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    command = [str(CLAUDE), "-p", prompt, *(["--continue"] if resume else [])]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=TURN_TIMEOUT_S, check=False)
    return ClaudeTurn(done.returncode, done.stdout, done.stderr)
