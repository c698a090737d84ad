"""Run the shell examples of README.md and docs/*.md that are marked runnable, and report each.

A fenced ```sh (or ```bash) block is runnable when the line before its fence is the marker
`<!-- runnable -->`. Mark only commands that finish in seconds on the embedded model. Each block
runs as one `bash -euo pipefail` script from the repository root, in order, with MLXKV_CACHE_DIR
set to a fresh temporary directory shared by the blocks of one run (so `mlxkv cache ls` sees what
an earlier `mlxkv generate` wrote, and the user's own cache is never touched).

Run: `uv run python -m tools.check_docs [--timeout 300] [--list]`; exits 1 if any block fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE_MARKER = "<!-- runnable -->"
SHELL_LANGUAGES = ("sh", "bash", "shell")
_FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True, slots=True)
class CodeBlock:
    """A fenced code block: `line` is the 1-based line of its opening fence."""

    path: Path
    line: int
    language: str
    code: str
    runnable: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True, slots=True)
class Outcome:
    block: CodeBlock
    returncode: int  # -1: timed out
    seconds: float
    output: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/, in a stable order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def code_blocks(path: Path) -> Iterator[CodeBlock]:
    """The fenced blocks of one Markdown file; raises ValueError for a fence that never closes."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: code fence is never closed")
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        yield CodeBlock(path, i + 1, opening.group(1), "\n".join(lines[i + 1 : end]) + "\n", previous == RUNNABLE_MARKER)
        i = end + 1


def runnable_blocks(files: Sequence[Path]) -> list[CodeBlock]:
    return [block for path in files for block in code_blocks(path) if block.runnable]


def run_block(block: CodeBlock, timeout_s: float, env: dict[str, str]) -> Outcome:
    if block.language not in SHELL_LANGUAGES:
        raise ValueError(f"{block.where}: only {', '.join(SHELL_LANGUAGES)} blocks can be runnable, got {block.language!r}")
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        output = _text(e.stdout) + _text(e.stderr)
        return Outcome(block, -1, time.monotonic() - started, output + f"\n(timed out after {timeout_s:g} s)")
    return Outcome(block, done.returncode, time.monotonic() - started, done.stdout + done.stderr)


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", "replace")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the runnable shell examples of README.md and docs/.")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each block may take (default: 300)")
    parser.add_argument("--list", action="store_true", help="list the runnable blocks without running them")
    args = parser.parse_args(argv)
    blocks = runnable_blocks(doc_files())
    if args.list:
        for block in blocks:
            print(f"{block.where}\n{block.code}")
        return 0
    failed = 0
    with tempfile.TemporaryDirectory(prefix="mlxkv-check-docs-") as cache_dir:
        env = {**os.environ, "MLXKV_CACHE_DIR": cache_dir}
        for block in blocks:
            outcome = run_block(block, args.timeout, env)
            status = "PASS" if outcome.passed else "FAIL"
            print(f"{status} {block.where} ({outcome.seconds:.1f} s)", flush=True)
            if not outcome.passed:
                failed += 1
                tail = "\n".join(outcome.output.splitlines()[-20:])
                print(f"  exit {outcome.returncode}; last output:\n{tail}", flush=True)
    print(f"{len(blocks) - failed} of {len(blocks)} runnable blocks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
