"""The whole local cluster, started by `cosine up` as a user would, with the real target."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def cluster(target_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cluster-run")
    port = _free_port()
    env = dict(os.environ, COSINE_RUN_DIR=str(run_dir))
    proc = subprocess.Popen([sys.executable, "-m", "cosine.cli", "up", "--port", str(port), "--timeout", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    address = f"127.0.0.1:{port}"
    lines = []
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.strip() == address:
            break
    else:
        line = ""
    if proc.poll() is not None or not lines or lines[-1].strip() != address:
        proc.kill()
        pytest.fail("cosine up did not come up:\n" + "".join(lines))
    state = json.loads((run_dir / "cluster.json").read_text())
    yield {"address": address, "state": state, "run_dir": run_dir}
    proc.send_signal(signal.SIGINT)  # cosine up stops its services by PID
    try:
        proc.communicate(timeout=60)  # read what it prints while stopping: a full pipe would block it
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    finally:
        for entry in state["processes"]:  # what cosine up left running, by the PIDs it recorded
            _kill_leftover(entry["pid"])


def _kill_leftover(pid: int) -> None:
    """SIGKILL a service of this cluster still alive (its command line checked: a PID may be reused)."""
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return  # gone
    if "cosine." in cmdline or "redis-server" in cmdline:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
