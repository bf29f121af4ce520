"""A real `longdoc serve` subprocess on a free loopback port, and what the drills read off it."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.config import SMALL_MODEL

FIRST_PORT = 20_000  # above Ray's worker ports (10002-19999 by default)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A free loopback port below the range the OS hands out for port 0 (where there is room above
    FIRST_PORT), so no process started meanwhile, Ray's among them, takes it before the server
    binds it; else one the OS hands out."""
    first_ephemeral = int(EPHEMERAL_RANGE.read_text().split()[0]) if EPHEMERAL_RANGE.exists() else 0
    below = range(FIRST_PORT, first_ephemeral)  # empty where the OS's range starts lower
    for port in random.sample(below, min(200, len(below))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(process: subprocess.Popen, url: str, name: str, log: Path, timeout: float) -> None:
    """Poll `url` until it answers 200. Raises (the log's tail in the message) if the process exits;
    kills it and raises if `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{name} did not become ready")


@dataclass
class Server:
    """`longdoc <command> ARGS` (`serve`, or `serve-ray`); `start` waits until /readyz answers 200.

    The model is the small one (SmolLM2-135M, what the drills' figures are measured on) unless ARGS
    or LONGDOC_MODEL name another."""

    args: list[str]
    command: str = "serve"
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    log: Path = Path("/tmp/longdoc-drill-server.log")
    process: subprocess.Popen | None = None
    data_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="longdoc-drill-sessions-")))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> Server:
        cmd = [sys.executable, "-m", "clients.cli", self.command, "--port", str(self.port), "--log-level", "warning", *self.args]
        env = {
            "LONGDOC_MODEL": SMALL_MODEL,
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "LONGDOC_DATA_DIR": str(self.data_dir),
            **self.env,
        }
        self.process = subprocess.Popen(
            cmd, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=self.command != "serve"
        )
        wait_until_up(self.process, f"{self.url}/readyz", "the server", self.log, timeout)
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def rss_bytes(self) -> int:
        """Resident memory of the server process, from /proc."""
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        assert match is not None, "no VmRSS line in /proc/<pid>/status"
        return int(match.group(1)) * 1024

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        """`kill -9`: no shutdown of any kind."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> str:
        """Stop the server; its log."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.log.read_text()
