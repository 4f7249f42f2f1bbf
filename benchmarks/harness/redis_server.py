"""A real redis-server on a free loopback port (Debian's package, installed by scripts/install-test-deps.sh)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None,
                 options: tuple[str, ...] = ()):
        """`options`: more redis-server arguments (e.g. --maxmemory 4mb)."""
        self.workdir = workdir
        self.options = options
        self.port = port or free_port()
        self.password = password
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run scripts/install-test-deps.sh")
        command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--dir", str(self.workdir), "--logfile", str(self.workdir / f"redis-{self.port}.log")]
        if self.password:
            command += ["--requirepass", self.password]
        command += list(self.options)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, password=self.password, socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed Redis goes: no goodbye to connected clients."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
