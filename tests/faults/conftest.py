"""Fault tests: real processes killed, stopped and restarted with real signals; a real Redis stopped and restarted.

Drafters (and Redis) run as their own processes so a test can SIGKILL / SIGSTOP them; verifier,
fusion, scheduler and router run in the test's process on port 0, on tiny random models."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cosine.cluster import free_port, is_serving

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.faults)


class Proc:
    """One service process on a fixed loopback port, stopped by its own handle (never by name)."""

    def __init__(self, name: str, argv: list[str], port: int, grpc_service: bool = True):
        self.name, self.argv, self.port, self.grpc_service = name, argv, port, grpc_service
        self.popen: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> "Proc":
        env = dict(os.environ, PYTHONPATH=str(ROOT / "services"), TOKENIZERS_PARALLELISM="false")
        self.popen = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout_s
        while not self._up():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not start")
            time.sleep(0.1)
        return self

    def _up(self) -> bool:
        if self.grpc_service:
            return is_serving(self.address)
        import socket
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.popen is not None:
            if self.popen.poll() is None:
                self.signal(signal.SIGCONT)
                self.popen.kill()
            self.popen.wait(timeout=10)


def drafter_proc(name: str, kind: str, model: Path | None = None) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "cosine.drafter", "--port", str(port), "--name", name, "--kind", kind, "--threads", "1",
            "--log-level", "WARNING", "--drain-timeout-s", "0"]
    if model is not None:
        argv += ["--model", str(model)]
    return Proc(f"drafter-{name}", argv, port)


def redis_proc(port: int | None = None, maxmemory: str = "0", policy: str = "noeviction") -> Proc:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed")
    port = port or free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--maxmemory", maxmemory, "--maxmemory-policy", policy]
    return Proc("redis", argv, port, grpc_service=False)
