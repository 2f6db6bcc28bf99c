"""The local cluster: Redis and every service as its own process on loopback (`cosine up`).

`--replicas verifier=2,drafter-suffix=2,...` starts several copies of a role (named verifier-0,
verifier-1, ...). Callers reach them as the chart's pods are reached: the scheduler and fusion
through their endpoint pools (`cosine.common.pool`), given a targets file in the run folder that
`add_replica` extends while the cluster runs; the router through gRPC's round_robin over a list.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cosine.common.pool import write_targets_file
from cosine.common.server import READINESS
from cosine.zoo.registry import cache_root


_handed_out: set[int] = set()  # ports free_port gave this process: the OS may offer a closed probe's port again


def free_port() -> int:
    """A loopback port free now and not handed out before by this process (services bind it a moment later)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free loopback port found")


@dataclass
class DrafterSpec:
    name: str
    kind: str  # lm | ngram | suffix
    model: str = ""
    domain: str = "general"
    default: bool = True  # among the router's default candidates (else only for requests that name it)


def zoo_drafters() -> list[DrafterSpec]:
    """The drafters a local cluster runs by default: suffix decoding (the cheap drafter) plus every domain drafter
    `cosine zoo build` made (lm-code, lm-docs, ...; before a build, the untrained lm-2layer stands in for them);
    prompt lookup (ngram) runs too, for requests that name it, but is not a default candidate."""
    from cosine.zoo.registry import list_models

    built = [e for e in list_models() if e.kind == "lm" and e.domain != "general"]
    lms = [DrafterSpec(e.name, "lm", e.name, e.domain) for e in built] or [DrafterSpec("lm-2layer", "lm", "lm-2layer")]
    return [DrafterSpec("suffix", "suffix")] + lms + [DrafterSpec("ngram", "ngram", default=False)]


ROLES = ("verifier", "fusion", "scheduler")  # roles with replicas besides drafter-<name>; the router has one


def parse_replicas(text: str, drafters: list[str] | None = None) -> dict[str, int]:
    """'verifier=2,drafter-suffix=2' -> {"verifier": 2, "drafter-suffix": 2}; ValueError on a role
    that does not exist (given `drafters`, the drafter names) or a count below 1."""
    out: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        role, sep, count = item.partition("=")
        role = role.strip()
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"replicas {item!r}: expected ROLE=N with N >= 1")
        if role == "router":
            raise ValueError("the router runs once (clients connect to its port); replicate the roles behind it")
        known = role in ROLES or (role.startswith("drafter-") and (drafters is None or role[len("drafter-"):] in drafters))
        if not known:
            names = ", ".join([*ROLES, *(f"drafter-{d}" for d in drafters or ["NAME"])])
            raise ValueError(f"replicas: no role {role!r} (roles: {names})")
        out[role] = int(count)
    return out


@dataclass
class ClusterSpec:
    router_port: int = 50051
    redis_url: str = ""  # empty: start a private redis-server
    # the private redis-server's memory limit; at the limit writes fail (noeviction) and new requests get
    # RESOURCE_EXHAUSTED: evicting would drop running requests' state (the source of truth) mid-stream
    redis_maxmemory: str = "256mb"
    target: str = ""  # model dir or zoo name; empty: the zoo's target
    drafters: list[DrafterSpec] = field(default_factory=zoo_drafters)
    default_drafters: list[str] | None = None  # the router's default candidates; None: the drafters marked default
    verifier_threads: int = 2
    drafter_threads: int = 1
    log_level: str = "INFO"
    replicas: dict[str, int] = field(default_factory=dict)  # role ("verifier", "drafter-suffix", ...) -> copies


@dataclass
class Process:
    name: str
    pid: int
    address: str
    log: str
    metrics_port: int | None = None
    grpc: bool = True


def run_dir() -> Path:
    """Logs and the state file of the local cluster ($COSINE_RUN_DIR, or <cache>/run)."""
    return Path(os.environ.get("COSINE_RUN_DIR") or cache_root() / "run")


def state_file() -> Path:
    return run_dir() / "cluster.json"


class Cluster:
    """Starts, watches and stops the processes of one local cluster."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.processes: list[Process] = []
        self._popen: dict[int, subprocess.Popen] = {}
        self.router_address = f"127.0.0.1:{spec.router_port}"
        self._argv: dict[str, list[str]] = {}  # role -> its service's arguments (for add_replica)
        self._addresses: dict[str, list[str]] = {}  # role -> its replicas' addresses

    def _replicas(self, role: str, module: str, *args: str) -> str:
        """Start the role's replicas; returns the target its callers use: the address of a single one, else a
        targets file (file:PATH) that add_replica can extend."""
        count = self.spec.replicas.get(role, 1)
        self._argv[role] = [module, *args]
        self._addresses[role] = []
        for i in range(count):
            port = free_port()
            self._service(role if count == 1 else f"{role}-{i}", module, port, *args)
            self._addresses[role].append(f"127.0.0.1:{port}")
        if count == 1:
            return self._addresses[role][0]
        return f"file:{self._write_targets(role)}"

    def _write_targets(self, role: str) -> Path:
        path = run_dir() / f"{role}.targets"
        write_targets_file(path, self._addresses[role])
        return path

    def add_replica(self, role: str, timeout_s: float = 300.0) -> Process:
        """Start one more replica of a role started with several, wait until it is ready, then add it to the
        targets file its callers read again (they pick it up within pool_resolve_interval_s)."""
        if role not in self._argv or self.spec.replicas.get(role, 1) < 2:
            raise ValueError(f"{role} was not started with replicas (cosine up --replicas {role}=2)")
        module, *args = self._argv[role]
        port = free_port()
        proc = self._service(f"{role}-{len(self._addresses[role])}", module, port, *args)
        deadline = time.monotonic() + timeout_s
        while not is_serving(proc.address):
            popen = self._popen[proc.pid]
            if popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {popen.returncode}; its log ({proc.log}) ends:\n{tail(proc.log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} not ready after {timeout_s:.0f}s")
            time.sleep(0.2)
        self._addresses[role].append(proc.address)
        self._write_targets(role)
        self.save()
        return proc

    def _spawn(self, name: str, argv: list[str], address: str, metrics_port: int | None, grpc_service: bool = True) -> Process:
        run_dir().mkdir(parents=True, exist_ok=True)
        log_path = run_dir() / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self._popen[popen.pid] = popen
        proc = Process(name, popen.pid, address, str(log_path), metrics_port, grpc_service)
        self.processes.append(proc)
        return proc

    def _service(self, name: str, module: str, port: int, *args: str) -> Process:
        metrics = free_port()
        argv = [sys.executable, "-m", module, "--port", str(port), "--metrics-port", str(metrics), "--log-level", self.spec.log_level, *args]
        return self._spawn(name, argv, f"127.0.0.1:{port}", metrics)

    def start(self, timeout_s: float = 600.0, progress=None) -> None:
        spec = self.spec
        redis_url = spec.redis_url
        if not redis_url:
            binary = shutil.which("redis-server")
            if binary is None:
                raise RuntimeError("redis-server not found: install it (apt-get install -y redis-server) or pass --redis-url")
            port = free_port()
            self._spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                  "--maxmemory", spec.redis_maxmemory, "--maxmemory-policy", "noeviction"],
                        f"127.0.0.1:{port}", None, grpc_service=False)
            redis_url = f"redis://127.0.0.1:{port}/0"
        parse_replicas(",".join(f"{k}={v}" for k, v in spec.replicas.items()), [d.name for d in spec.drafters])
        target = ["--model", spec.target] if spec.target else []
        verifier = self._replicas("verifier", "cosine.verifier", "--threads", str(spec.verifier_threads), *target)
        endpoints = []
        for d in spec.drafters:
            model = ["--model", d.model] if d.model else []
            where = self._replicas(f"drafter-{d.name}", "cosine.drafter", "--name", d.name, "--kind", d.kind, "--domain", d.domain,
                                   "--threads", str(spec.drafter_threads), *model)
            endpoints.append(f"{d.name}={where}")
        fusion = self._replicas("fusion", "cosine.fusion", "--drafters", ",".join(endpoints))
        defaults = spec.default_drafters if spec.default_drafters is not None else [d.name for d in spec.drafters if d.default]
        scheduler = self._replicas("scheduler", "cosine.scheduler", "--verifier", verifier, "--fusion", fusion, "--redis-url", redis_url)
        # the router picks schedulers through its endpoint pool (and resumes a request on another when one fails);
        # fusion, which it only asks for drafter names, through one channel: a list goes to gRPC's round_robin (ipv4:A,B)
        self._service("router", "cosine.router", spec.router_port, "--scheduler", scheduler,
                      "--fusion", self._channel_target("fusion"), "--default-drafters", json.dumps(defaults), *target)
        self.save()
        try:
            self.wait_ready(timeout_s, progress)
        except BaseException:
            self.stop()
            raise

    def _channel_target(self, role: str) -> str:
        addresses = self._addresses[role]
        return addresses[0] if len(addresses) == 1 else "ipv4:" + ",".join(addresses)

    def wait_ready(self, timeout_s: float, progress=None) -> None:
        deadline = time.monotonic() + timeout_s
        pending = [p for p in self.processes if p.grpc]
        while pending:
            for proc in list(pending):
                popen = self._popen.get(proc.pid)
                if popen is not None and popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited with {popen.returncode}; its log ({proc.log}) ends:\n{tail(proc.log)}")
                if is_serving(proc.address):
                    pending.remove(proc)
                    if progress is not None:
                        progress(proc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout_s:.0f}s: {[p.name for p in pending]} (logs in {run_dir()})")
            time.sleep(0.2)
        # callers reach a replica that came up within reconnect_backoff_max_s (0.5 s, with gRPC's 20% jitter) and
        # learn it is ready from their next load poll (pool_poll_interval_s, 0.5 s): wait for both, so the first
        # requests are spread over every replica rather than the ones that happened to be ready first
        time.sleep(1.5)

    def save(self) -> None:
        state = {"router": self.router_address, "processes": [asdict(p) for p in self.processes]}
        state_file().write_text(json.dumps(state, indent=2))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self._popen.values())

    def stop(self, timeout_s: float = 20.0) -> None:
        stop_pids([p.pid for p in self.processes], timeout_s, self._popen)
        self.processes.clear()
        if state_file().exists():
            state_file().unlink()


def tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def is_serving(address: str, service: str = READINESS) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def stop_pids(pids: list[int], timeout_s: float = 20.0, popen: dict[int, subprocess.Popen] | None = None) -> None:
    """SIGTERM each process (they drain), SIGKILL what is left after the timeout. By PID, never by name."""
    popen = popen or {}
    for pid in reversed(pids):  # router first, Redis last
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline and _running(pid, popen.get(pid)):
            time.sleep(0.1)
        if _running(pid, popen.get(pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if pid in popen:
            popen[pid].wait()


def _running(pid: int, popen: subprocess.Popen | None) -> bool:
    if popen is not None:
        return popen.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie we are not the parent of counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def stop_saved(timeout_s: float = 20.0) -> bool:
    """Stop the cluster `cosine up --detach` left running; False if none is recorded."""
    path = state_file()
    if not path.exists():
        return False
    state = json.loads(path.read_text())
    stop_pids([p["pid"] for p in state["processes"]], timeout_s)
    path.unlink()
    return True
