import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_CACHE, REPO

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`statekeeper serve` in a subprocess, as a user would run it."""

    def __init__(self, data_dir: Path, **env):
        self.data_dir = data_dir
        self.port = free_port()
        # Lossless by default: these tests compare restored turns with hot ones token by token.
        lossless = {"STATEKEEPER_COMPRESSION_POLICY": "none", "STATEKEEPER_COMPRESSION_CODEC": "none"}
        self.env = os.environ | {"STATEKEEPER_MODEL_CACHE_DIR": str(MODEL_CACHE)} | lossless | env
        self.process: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> "ServerProcess":
        command = [sys.executable, "-m", "statekeeper.cli", "serve", "--port", str(self.port),
                   "--data-dir", str(self.data_dir)]
        self.log = open(self.data_dir / f"server-{time.time_ns()}.log", "w")
        self.process = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {(self.data_dir / self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=300)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


@pytest.fixture
def server_factory(tmp_path):
    started = []

    def make(**env) -> ServerProcess:
        server = ServerProcess(tmp_path, **env)
        started.append(server)
        return server.start()

    yield make
    for server in started:
        server.stop()
