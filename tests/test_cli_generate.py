"""`mlxkv generate` end to end, as a user runs it (the installed console script)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxkv.cli import build_parser, main

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


def commands(parser: argparse.ArgumentParser, name: str = "mlxkv") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command and subcommand parser under `parser`, by its full name."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from commands(sub, f"{name} {sub_name}")


def test_help_lists_every_option_with_a_description(capsys: pytest.CaptureFixture[str]) -> None:
    found = dict(commands(build_parser()))
    assert {"mlxkv generate", "mlxkv serve", "mlxkv cache", "mlxkv cache ls"} <= set(found)
    for name, parser in found.items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help != argparse.SUPPRESS and action.help.strip(), f"{label} has no description"
        with pytest.raises(SystemExit) as exit_info:
            main([*name.split()[1:], "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert all(option in out for action in parser._actions for option in action.option_strings), name


def test_bad_values_are_clear_errors_not_tracebacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--top-p", "0"]) == 2
    assert "top_p=0.0 is out of range; allowed: (0, 1]" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/nonexistent/model"]) == 2
    assert "nothing is downloaded" in capsys.readouterr().err


def test_embedded_generate_with_a_json_schema_prints_matching_json(tmp_path: Path) -> None:
    schema = '{"type": "object", "properties": {"capital": {"enum": ["Paris", "Lyon"]}}, "required": ["capital"], "additionalProperties": false}'
    done = subprocess.run(
        [MLXKV, "generate", "What is the capital of France?", "--max-tokens", "16", "--json-schema", schema, "--no-ssd-cache"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert done.stdout.strip() in ('{"capital": "Paris"}', '{"capital": "Lyon"}')


def test_generate_with_a_regex_that_does_not_compile_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--regex", "a(b", "--no-ssd-cache"]) == 2
    assert "does not compile" in capsys.readouterr().err
