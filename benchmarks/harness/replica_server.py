"""`statekeeper serve` (uvicorn) in a process of its own on a free loopback port: a replica, for the tests
where several share one PostgreSQL history and one Redis (leases and the shared KV tier), and one may be
killed as a crashed machine is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.harness.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]


class ReplicaServer:
    def __init__(self, data_dir: Path, settings: dict[str, str], port: int | None = None):
        """`settings`: STATEKEEPER_* names without the prefix (MODEL, POSTGRES_DSN, ...)."""
        self.data_dir = data_dir
        self.port = port or free_port()
        self.settings = settings
        self.process: subprocess.Popen | None = None
        self.log_path = data_dir / f"replica-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ReplicaServer":
        """Starts the process; `wait_ready` waits for it (start several, then wait for each)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {name: value for name, value in os.environ.items() if not name.startswith("STATEKEEPER_")}
        env |= {f"STATEKEEPER_{name}": str(value) for name, value in self.settings.items()}
        env["PYTHONPATH"] = str(REPO)
        command = [sys.executable, "-m", "statekeeper.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--data-dir", str(self.data_dir)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = 180) -> "ReplicaServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"replica exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"replica not ready after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL, as a crashed machine goes: no shutdown, its leases expire by themselves."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def start_all(servers: list[ReplicaServer]) -> list[ReplicaServer]:
    """Starts every replica, then waits for each (they load their models side by side); stops them all if
    one does not come up."""
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.wait_ready()
    except Exception:
        for server in servers:
            server.stop()
        raise
    return servers


def create_session(url: str) -> str:
    """A new conversation on the replica at `url` (REST API)."""
    response = httpx.post(f"{url}/v1/sessions", json={"system": "Be brief."})
    assert response.status_code == 201
    return response.json()["id"]


def post_turn(url: str, session: str, content: str, max_tokens: int = 8) -> httpx.Response:
    """One turn on the replica at `url`, whatever it answers."""
    return httpx.post(f"{url}/v1/sessions/{session}/messages", json={"content": content, "max_tokens": max_tokens},
                      timeout=60)
