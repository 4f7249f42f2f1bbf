"""A real PostgreSQL (Debian's package, installed by scripts/install-test-deps.sh): a throwaway cluster in a
temporary directory, listening on a free loopback port only (no Unix socket), trust authentication.

PostgreSQL refuses to run as root: under root the cluster belongs to the `postgres` user that Debian's
package creates, and initdb and pg_ctl run as that user (runuser)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psycopg

from benchmarks.harness.redis_server import free_port


def postgres_bin_dir() -> Path | None:
    """The folder of initdb and pg_ctl: on PATH, else Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    return None


def missing_reason() -> str | None:
    """Why no cluster can be started here, or None."""
    if postgres_bin_dir() is None:
        return "PostgreSQL is not installed (initdb, pg_ctl): run scripts/install-test-deps.sh"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a `postgres` user to run PostgreSQL as"
    return None


class PostgresServer:
    def __init__(self, port: int | None = None, durable: bool = False):
        self.port = port or free_port()
        self.durable = durable  # fsync and synchronous commit, as in production (benchmarks); off for tests
        self.root = Path(tempfile.mkdtemp(prefix="statekeeper-pg-"))
        self.data = self.root / "data"
        self.bin = postgres_bin_dir()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)

    def _run(self, *command: str) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if self._as_postgres else []
        return subprocess.run(prefix + list(command), check=True, capture_output=True, text=True, timeout=120)

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> "PostgresServer":
        if self.bin is None:
            raise RuntimeError("PostgreSQL is not installed: run scripts/install-test-deps.sh")
        if not (self.data / "PG_VERSION").exists():
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                      "--locale=C", "--no-sync")
        options = f"-p {self.port} -h 127.0.0.1 -k '' -c max_connections=200"
        if not self.durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "postgres.log"), "-o", options,
                  "-w", "-t", "60", "start")
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(self.dsn(), connect_timeout=2).close()
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl stop: `fast` disconnects clients and shuts down cleanly, `immediate` as a crash would."""
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def create_database(self) -> str:
        """A new empty database; its DSN."""
        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.dsn(), autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.dsn(name)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
