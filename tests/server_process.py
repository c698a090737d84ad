"""`mlxkv serve` as a real subprocess (for shutdown and crash tests)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.serving import free_port


def wait_until_healthy(name: str, process: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    """Poll `url`/health until it answers 200; a process that exits or stays unhealthy raises
    with its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited early:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not become healthy:\n{log.read_text()}")


class ServerProcess:
    def __init__(self, cache_dir: Path, *extra: str, ready_timeout: float = 120) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cache_dir.parent / f"serve-{self.port}.log"
        self._log_file = self.log.open("w")
        command = [str(Path(sys.executable).parent / "mlxkv"), "serve", "--port", str(self.port),
                   "--ssd-cache", str(cache_dir), "--log-level", "warning", *extra]
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT)
        wait_until_healthy("mlxkv serve", self.process, self.url, self.log, ready_timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self._log_file.close()
