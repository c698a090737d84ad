"""`mlxkv generate` end to end, as a user runs it (the installed console script)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxkv.cli import main

MLXKV = str(Path(sys.executable).parent / "mlxkv")


def test_embedded_generate_names_paris(tmp_path: Path) -> None:
    done = subprocess.run(
        [MLXKV, "generate", "What is the capital of France?", "--max-tokens", "24", "--temp", "0", "--ssd-cache", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "Paris" in done.stdout
    if sys.platform == "linux":  # the start-up line names the kernels (native by default) and the BLAS
        assert "mlxkv generate: cpu kernels native (" in done.stderr and "; BLAS mlxkv-sgemm (" in done.stderr
    stats = done.stderr.strip().splitlines()[-1]
    assert stats.startswith("prompt: 37 tokens (0 cached)")
    assert "finish: stop" in stats


def test_help_lists_every_option_with_a_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model", "--max-tokens", "--temp", "--top-p", "--top-k", "--min-p", "--seed", "--raw", "--stop",
                   "--kv-bits", "--kv-group-size", "--quantized-kv-start", "--prefill-step-size"):
        assert option in out


def test_bad_values_are_clear_errors_not_tracebacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--top-p", "0"]) == 2
    assert "top_p=0.0 is out of range; allowed: (0, 1]" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/nonexistent/model"]) == 2
    assert "nothing is downloaded" in capsys.readouterr().err
