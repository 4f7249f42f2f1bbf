"""A real nginx (Debian's package, installed by scripts/install-test-deps.sh) running docker/nginx/scale.conf
in front of replicas on loopback: the compose file's proxy, with only its upstream addresses and listen
port replaced. It runs in the foreground of its own process, everything it writes in its directory."""

from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from benchmarks.harness.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
SCALE_CONF = REPO / "docker" / "nginx" / "scale.conf"
COMPOSE_UPSTREAMS = ("replica-a:8000", "replica-b:8000")
# Each proxied request: its URI, the replica that answered it and its status (parse_access_log).
LOG_FORMAT = '$request_method|$request_uri|$upstream_addr|$status'


def nginx_binary() -> str | None:
    """Debian installs it in /usr/sbin, which is not on every PATH."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")


def render_scale_conf(upstreams: list[str], port: int, text: str | None = None) -> str:
    """scale.conf (or `text`) with replica-a:8000 and replica-b:8000 replaced by `upstreams` and its
    listen port by 127.0.0.1:`port`; nothing else changes."""
    text = SCALE_CONF.read_text() if text is None else text
    for compose, address in zip(COMPOSE_UPSTREAMS, upstreams, strict=True):
        assert f"server {compose} " in text, f"scale.conf has no upstream {compose}"
        text = text.replace(f"server {compose} ", f"server {address} ")
    text, listens = re.subn(r"\blisten 8080;", f"listen 127.0.0.1:{port};", text)
    assert listens == 1, "scale.conf listens on 8080 once"
    return text


class NginxProxy:
    def __init__(self, workdir: Path, upstreams: list[str], port: int | None = None, conf_text: str | None = None):
        """`upstreams`: host:port of replica-a and replica-b; `conf_text`: scale.conf's text, if not the repo's."""
        self.workdir = workdir
        self.port = port or free_port()
        self.upstreams = upstreams
        self.conf_text = conf_text
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def access_log(self) -> Path:
        return self.workdir / "access.log"

    @property
    def error_log(self) -> Path:
        return self.workdir / "error.log"

    def write_config(self) -> Path:
        w = self.workdir
        w.mkdir(parents=True, exist_ok=True)
        (w / "scale.conf").write_text(render_scale_conf(self.upstreams, self.port, self.conf_text))
        temp_paths = "\n".join(f"    {name}_temp_path {w / (name + '_temp')};"
                               for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        # As root, nginx's workers would run as nobody, who cannot enter a private temporary directory.
        user = ""
        if os.geteuid() == 0:
            user = f"user {pwd.getpwuid(os.getuid()).pw_name} {grp.getgrgid(os.getgid()).gr_name};\n"
        config = w / "nginx.conf"
        config.write_text(
            f"{user}worker_processes 1;\npid {w / 'nginx.pid'};\nerror_log {self.error_log} warn;\n"
            f"events {{}}\n"
            f"http {{\n"
            f"    log_format upstream '{LOG_FORMAT}';\n"
            f"    access_log {self.access_log} upstream;\n"
            f"{temp_paths}\n"
            f"    include {w / 'scale.conf'};\n"
            f"}}\n")
        return config

    def start(self, timeout_s: float = 15) -> "NginxProxy":
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed: run scripts/install-test-deps.sh")
        config = self.write_config()
        command = [binary, "-p", str(self.workdir), "-e", str(self.error_log), "-c", str(config),
                   "-g", "daemon off;"]
        check = subprocess.run(command[:-2] + ["-t"], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"nginx refuses the configuration:\n{check.stderr}")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx not listening after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.error_log.read_text(errors="replace")[-chars:] if self.error_log.exists() else ""

    def requests(self) -> list[tuple[str, str, str, int]]:
        """Every proxied request so far, in the order they ended: (method, URI, upstream host:port, status).
        A request that was tried on more than one replica names the one that answered it (the last)."""
        if not self.access_log.exists():
            return []
        rows = []
        for line in self.access_log.read_text().splitlines():
            method, uri, upstream, status = line.split("|")
            rows.append((method, uri, upstream.split(",")[-1].strip(), int(status)))
        return rows

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful: finishes the requests under way
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
