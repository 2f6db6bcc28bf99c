"""The replicas of one role a caller talks to, each with its own channel, picked by load per request.

A ClusterIP Service and one long-lived channel tie every request to one pod; gRPC's round_robin
spreads calls but knows nothing of load or of a request's KV cache. `EndpointPool` keeps one
channel per replica and polls each replica's `cosine.common.v1.Load/Report` (readiness plus load,
one cheap call), so the caller places each new request on the least-loaded ready replica
(`cosine.common.picking`) and keeps the request's streams there. The caller pairs each `pick()` with
a `release()` when the request ends: its own requests on a replica are then counted exactly, and
the report only adds the others' (a report lags the opens by up to a poll interval).

Targets (what a service's address setting holds):

* ``HOST:PORT[,HOST:PORT...]`` (or gRPC's ``ipv4:HOST:PORT,HOST:PORT``) — a fixed list;
* ``dns:///HOST:PORT`` — every address HOST resolves to (a headless Service lists each pod),
  resolved again every ``pool_resolve_interval_s``: pods that appear are polled and join, pods
  that vanish take no new requests;
* ``file:PATH`` — HOST:PORT entries, one per line (or comma-separated; ``#`` starts a comment),
  read again like DNS: `cosine up --replicas` writes these, and a replica added to the file joins.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from cosine.common.config import ServiceSettings
from cosine.common.errors import ServiceError
from cosine.common.picking import Candidate, Load, choose
from cosine.common.server import open_channel
from cosine.common.v1 import common_pb2, common_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Endpoint:
    """One replica: its channel, its latest load report and whether it takes new requests."""

    name: str  # "<role>-<n>", stable while the pool lives (logs and metrics; never an address)
    address: str
    channel: grpc.aio.Channel
    report: common_pb2.LoadReport | None = None  # latest Load report (None: none yet, or the replica does not report)
    healthy: bool = False
    busy_share: float = 0.0  # share of wall time its model thread was busy between the latest two reports
    down_at: float = float("-inf")  # when the caller marked it down: polls sent earlier do not re-admit it
    placed: int = 0  # this caller's requests on it now (picked, not yet released)
    others: int = 0  # requests of other callers on it, as of the latest report
    _busy: tuple[float, float] | None = None  # (when, busy_seconds) of the latest report

    @property
    def load(self) -> Load:
        """Its load apart from this caller's own requests (those are `placed`)."""
        r = self.report
        return Load() if r is None else Load(live=self.others, capacity=r.capacity, queued=r.queued)

    def __repr__(self) -> str:  # no address: reprs end up in logs and error texts
        return f"Endpoint({self.name}, healthy={self.healthy})"


def parse_targets(targets: str) -> tuple[str, str]:
    """(kind, value): ("list", "a:1,b:2"), ("dns", "host:port") or ("file", path)."""
    targets = targets.strip()
    if not targets:
        raise ValueError("an address is empty: give HOST:PORT[,HOST:PORT...], dns:///HOST:PORT or file:PATH")
    if targets.startswith("dns:"):
        rest = targets[4:]
        if rest.startswith("//"):  # dns://[authority]/host:port
            rest = rest[2:].split("/", 1)[1] if "/" in rest[2:] else ""
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{targets!r}: a dns target is dns:///HOST:PORT")
        return "dns", rest
    if targets.startswith("file:"):
        path = targets[5:]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError(f"{targets!r}: a file target is file:PATH")
        return "file", path
    if targets.startswith("ipv4:"):  # gRPC's own list form (ipv4:A:1,B:2), as the local cluster gives the router
        targets = targets[5:]
    parts = [p.strip() for p in targets.split(",")]
    if not all(parts):
        raise ValueError(f"{targets!r}: an empty entry in the address list")
    return "list", ",".join(parts)


def read_targets_file(path: str) -> list[str]:
    """The HOST:PORT entries of a targets file (missing file: none)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        out += [p.strip() for p in line.split(",") if p.strip()]
    return list(dict.fromkeys(out))


def write_targets_file(path: str | Path, addresses: Iterable[str]) -> None:
    """Write a targets file atomically (readers never see half of it)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{a}\n" for a in addresses))
    tmp.replace(path)


class EndpointPool:
    """The replicas of `role` named by `targets` (see the module's notes); `start()` before `pick()`."""

    def __init__(self, role: str, targets: str, settings: ServiceSettings):
        self.role = role
        self.kind, self._target = parse_targets(targets)
        self.settings = settings
        self.poll_interval_s = settings.pool_poll_interval_s
        self.resolve_interval_s = settings.pool_resolve_interval_s
        self._endpoints: dict[str, Endpoint] = {}  # address -> endpoint taking new requests
        self._retired: dict[str, Endpoint] = {}  # address -> endpoint no longer resolved, still holding our requests
        self._count = 0
        self._turn = 0
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self._closed = False

    # -- what callers use -------------------------------------------------------------------------

    def endpoints(self) -> list[Endpoint]:
        """Every endpoint taking new requests, healthy or not, in the order they joined."""
        return list(self._endpoints.values())

    def pick(self, exclude: frozenset = frozenset(), place: bool = True) -> Endpoint:
        """The least-loaded healthy endpoint not in `exclude` (endpoints or their names); ties round robin.
        With `place` (a new request goes there) it counts as one more request on it until `release()`;
        without (a one-off call such as Info) it does not."""
        candidates = [e for e in self._endpoints.values() if e.healthy and e not in exclude and e.name not in exclude]
        if not candidates:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"no {self.role} replica is reachable; retry shortly (if it persists, check that the "
                               f"{self.role} is running and ready)")
        index = choose([Candidate(e.load, e.placed) for e in candidates], self._turn)
        self._turn += 1
        chosen = candidates[index]
        if place:
            chosen.placed += 1
        return chosen

    def release(self, endpoint: Endpoint) -> None:
        """A request placed on `endpoint` by `pick()` ended."""
        endpoint.placed = max(0, endpoint.placed - 1)

    def mark_down(self, endpoint: Endpoint) -> None:
        """Take no new requests to `endpoint` until a health poll sent after now passes again."""
        if endpoint.healthy:
            log.warning("%s: %s marked down; new requests go to other replicas", self.role, endpoint.name)
        endpoint.healthy = False
        endpoint.down_at = time.monotonic()

    async def wait_ready(self, timeout: float) -> Endpoint:
        """Wait until some endpoint is healthy (start-up); raises ServiceError UNAVAILABLE after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.pick(place=False)
            except ServiceError:
                if time.monotonic() >= deadline:
                    raise
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(self.poll_interval_s, max(0.0, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                pass

    # -- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the targets, poll every endpoint once, then keep polling and resolving in the background."""
        await self._resolve()
        await self._poll_all()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for endpoint in [*self._endpoints.values(), *self._retired.values()]:
            await endpoint.channel.close()
        self._endpoints.clear()
        self._retired.clear()

    async def _run(self) -> None:
        resolved_at = time.monotonic()
        while not self._closed:
            await asyncio.sleep(self.poll_interval_s)
            try:
                if self.kind != "list" and time.monotonic() - resolved_at >= self.resolve_interval_s:
                    resolved_at = time.monotonic()
                    await self._resolve()
                await self._poll_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep polling; the next round may succeed
                log.warning("%s pool: polling failed", self.role, exc_info=True)

    # -- resolution -------------------------------------------------------------------------------

    async def _addresses(self) -> list[str] | None:
        """The addresses the targets name now; None when they cannot be read (keep what we have)."""
        if self.kind == "list":
            return self._target.split(",")
        if self.kind == "file":
            return read_targets_file(self._target)
        host, _, port = self._target.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("%s pool: cannot resolve its dns target (%s); keeping %d endpoints", self.role, exc, len(self._endpoints))
            return None
        out = []
        for family, *_, sockaddr in infos:
            ip = sockaddr[0]
            out.append(f"[{ip}]:{sockaddr[1]}" if family == socket.AF_INET6 else f"{ip}:{sockaddr[1]}")
        return list(dict.fromkeys(out))

    async def _resolve(self) -> None:
        addresses = await self._addresses()
        if addresses is None:
            return
        if not addresses and self._endpoints and self.kind == "dns":
            return  # a DNS answer without addresses mid-rollout: keep what we have
        wanted = set(addresses)
        for address in [a for a in self._endpoints if a not in wanted]:
            endpoint = self._endpoints.pop(address)
            self._retired[address] = endpoint  # streams open on it go on; no new requests
            log.info("%s: %s left the pool", self.role, endpoint.name)
        joined = []
        for address in addresses:
            if address in self._endpoints:
                continue
            endpoint = self._retired.pop(address, None) or self._new_endpoint(address)
            endpoint.healthy = False  # until a poll says it is ready
            joined.append(endpoint)
        if joined:
            await asyncio.gather(*(self._poll(e) for e in joined))
            for endpoint in joined:
                self._endpoints[endpoint.address] = endpoint
                log.info("%s: %s joined the pool", self.role, endpoint.name)
            self._changed.set()
        for address, endpoint in list(self._retired.items()):
            if endpoint.placed == 0:  # none of our requests left on it: its channel goes
                del self._retired[address]
                await endpoint.channel.close()

    def _new_endpoint(self, address: str) -> Endpoint:
        options = []
        if self.kind == "dns" and self.settings.tls_ca_file:
            # the certificate names the Service, not the pod's IP
            options.append(("grpc.ssl_target_name_override", self._target.rpartition(":")[0]))
        channel = open_channel(address, self.settings, extra_options=options)
        name = f"{self.role}-{self._count}"
        self._count += 1
        return Endpoint(name, address, channel)

    # -- load and health --------------------------------------------------------------------------

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(e) for e in list(self._endpoints.values())))

    async def _poll(self, endpoint: Endpoint) -> None:
        sent = time.monotonic()
        placed = endpoint.placed  # ours as the report is asked for: the rest of its count is others'
        was = endpoint.healthy
        try:
            report = await common_pb2_grpc.LoadStub(endpoint.channel).Report(
                common_pb2.LoadRequest(), timeout=max(0.5, 2 * self.poll_interval_s))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # serves, but reports no load: count it as idle
                report = common_pb2.LoadReport(ready=True)
            else:
                endpoint.healthy = False
                if was:
                    log.warning("%s: %s stopped answering (%s); new requests go to other replicas", self.role,
                                endpoint.name, exc.code().name)
                self._changed.set()
                return
        now = time.monotonic()
        if endpoint._busy is not None and now > endpoint._busy[0]:
            endpoint.busy_share = max(0.0, min(1.0, (report.busy_seconds - endpoint._busy[1]) / (now - endpoint._busy[0])))
        endpoint._busy = (now, report.busy_seconds)
        endpoint.report = report
        endpoint.others = max(0, report.live_requests - placed)
        if sent >= endpoint.down_at:
            endpoint.healthy = report.ready
        if endpoint.healthy != was:
            (log.info if endpoint.healthy else log.warning)("%s: %s is %s", self.role, endpoint.name,
                                                            "ready" if endpoint.healthy else "not ready")
        self._changed.set()
