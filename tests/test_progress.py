"""Progress of long work: exact prefill progress per chunk, a status line only on a terminal,
and info log lines for a long prefill in the server."""

from __future__ import annotations

import io
import logging
import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxkv.cli import main
from mlxkv.progress import PrefillLog
from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding
from tests.factories import make_prompt, make_tiny_binding
from tests.test_cli_cache import filled
from tests.factories import save_mlx_lm_directory

MLXKV = str(Path(sys.executable).parent / "mlxkv")


def prefill_reports(binding: MlxAutoregressiveBinding, prompt: list[int], cached: int = 0,
                    snapshot_at: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    caches = binding.make_cache()
    binding.prefill(prompt[:cached], caches)
    reports: list[tuple[int, int]] = []
    Generation(binding, prompt, GenerationParams(max_tokens=1, prefill_chunk=5), caches, snapshot_at=snapshot_at,
               on_prefill_progress=lambda d, t: reports.append((d, t))).run()
    return reports


def test_prefill_progress_reports_done_and_total_after_every_chunk() -> None:
    binding, prompt = make_tiny_binding("llama"), make_prompt(23)
    # 22 tokens are prefilled (the last one is the first decode step's), in chunks of 5.
    assert prefill_reports(binding, prompt) == [(0, 22), (5, 22), (10, 22), (15, 22), (20, 22), (22, 22)]
    # A snapshot point splits the prefill; the count runs on over the whole of it.
    assert prefill_reports(binding, prompt, snapshot_at=(12,)) == [(0, 22), (5, 22), (10, 22), (12, 22), (17, 22), (22, 22)]
    # A cached prefix is not prefilled again, nor counted.
    assert prefill_reports(binding, prompt, cached=8) == [(0, 14), (5, 14), (10, 14), (14, 14)]
    assert prefill_reports(binding, prompt, cached=22) == []


def test_prefill_log_logs_every_chunk_once_the_prefill_is_long(caplog: pytest.LogCaptureFixture) -> None:
    ticks = iter([0.0, 2.0, 4.0, 6.0, 8.0])
    log = PrefillLog("generation g1", after_s=5.0, clock=lambda: next(ticks))
    with caplog.at_level(logging.INFO, logger="mlxkv.progress"):
        for done in (0, 100, 200, 300, 400):
            log(done, 400)
    assert [r.getMessage() for r in caplog.records] == [
        "generation g1: prefill 300/400 tokens, 50.0 tok/s after 6 s",
        "generation g1: prefill 400/400 tokens, 50.0 tok/s after 8 s",
    ]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "tiny-llama"
    save_mlx_lm_directory(make_tiny_binding("llama"), directory)
    return directory


def generate_args(model: Path, cache: Path) -> list[str]:
    return ["generate", "abcdefghijklmnopqrstuvwxyz", "--raw", "--model", str(model), "--max-tokens", "3", "--temp", "0",
            "--prefill-step-size", "8", "--ssd-cache", str(cache)]


def test_generate_prints_only_its_start_up_and_stats_lines_when_stderr_is_not_a_terminal(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(generate_args(tiny_model, tmp_path)) == 0
    err = capsys.readouterr().err
    start_up, stats = err.splitlines()
    assert start_up.startswith("mlxkv generate: cpu kernels ") and stats.startswith("prompt: 26 tokens (0 cached)")
    assert "\r" not in err


def read_all(fd: int) -> Iterator[bytes]:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the terminal's other end closed
            return
        if not chunk:
            return
        yield chunk


def test_generate_shows_load_and_prefill_progress_on_a_terminal(tiny_model: Path, tmp_path: Path) -> None:
    controller, terminal = pty.openpty()
    process = subprocess.Popen([MLXKV, *generate_args(tiny_model, tmp_path)], stdout=subprocess.PIPE, stderr=terminal)
    os.close(terminal)
    shown = b"".join(read_all(controller)).decode()
    os.close(controller)
    assert process.wait(120) == 0 and process.stdout is not None and process.stdout.read()
    assert f"\r\x1b[Kloading {tiny_model} ..." in shown
    # 25 tokens prefilled in chunks of 8: each step is shown, the line is gone once prefill is done.
    for done in (0, 8, 16, 24):
        assert f"\r\x1b[Kprefill {done}/25 tokens" in shown
    assert "prefill 25/25" not in shown
    assert shown.split("\x1b[K")[-1].startswith("prompt: 26 tokens (0 cached)")  # cleared before the stats line


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_cache_verify_shows_its_scan_on_a_terminal_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    files = filled(tmp_path)
    assert main(["cache", "--cache-dir", str(tmp_path), "verify"]) == 0
    assert capsys.readouterr().err == ""
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["cache", "--cache-dir", str(tmp_path), "verify"]) == 0
    shown = terminal.getvalue()
    for i, path in enumerate(files, 1):
        assert f"\r\x1b[Kverifying {i}/2: {path.name}" in shown
    assert shown.endswith("\r\x1b[K")  # the line is cleared before the summary
    assert capsys.readouterr().out == "2 of 2 files verified\n"
