"""`mlxkv serve` as a real subprocess (for shutdown and crash tests)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.serving import free_port


class ServerProcess:
    def __init__(self, cache_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cache_dir.parent / f"serve-{self.port}.log"
        self._log_file = self.log.open("w")
        command = [str(Path(sys.executable).parent / "mlxkv"), "serve", "--port", str(self.port),
                   "--ssd-cache", str(cache_dir), "--log-level", "warning", *extra]
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT)
        self._wait_healthy(120)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlxkv serve exited early:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"mlxkv serve did not become healthy:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self._log_file.close()
