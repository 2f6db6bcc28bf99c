"""One bootstrap for every service: grpc.aio server, health, reflection, metrics, tracing, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cosine.common.config import ServiceSettings
from cosine.common.errors import ErrorInterceptor
from cosine.common.metrics import ServiceMetrics
from cosine.common.tracing import Tracing
from cosine.common.v1 import common_pb2, common_pb2_grpc

log = logging.getLogger(__name__)

# Health service names Kubernetes probes ask for (plus "" for the whole server).
LIVENESS = "liveness"
READINESS = "readiness"


def channel_options(settings: ServiceSettings) -> list[tuple[str, int]]:
    """Options for servers and for channels between services."""
    size = settings.max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # a dns:/// target naming a headless Service resolves to every replica: spread calls over them
        # (a request's stream stays on the replica it opened on; one address behaves as pick_first)
        ("grpc.lb_policy_name", "round_robin"),
        # re-resolve at most every 5 s (gRPC's default: 30 s) when a server's GOAWAY (max_connection_age) asks for it
        ("grpc.dns_min_time_between_resolutions_ms", 5_000),
    ]


def server_credentials(settings: ServiceSettings) -> grpc.ServerCredentials | None:
    """TLS for the server's port when it has a certificate; client certificates required with tls_client_ca_file."""
    if not settings.tls_cert_file:
        return None
    client_ca = Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
    pair = (Path(settings.tls_key_file).read_bytes(), Path(settings.tls_cert_file).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def open_channel(target: str, settings: ServiceSettings, extra_options: list[tuple[str, object]] | None = None) -> grpc.aio.Channel:
    """A channel to another service: TLS verified with tls_ca_file (presenting this service's certificate) when set."""
    # a caller that starts before the service it calls (every process of `cosine up` starts at once, pods in any
    # order) keeps trying to connect; with gRPC's default backoff (1 s growing 1.6x a try, to 120 s) a replica that
    # came up after a few failed tries went unseen for seconds and took no share of the load meanwhile
    backoff_ms = int(settings.reconnect_backoff_max_s * 1000)
    options = channel_options(settings) + [("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
                                           ("grpc.max_reconnect_backoff_ms", backoff_ms)] + list(extra_options or [])
    if not settings.tls_ca_file:
        return grpc.aio.insecure_channel(target, options=options)
    own = settings.tls_cert_file
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(settings.tls_ca_file).read_bytes(),
        private_key=Path(settings.tls_key_file).read_bytes() if own else None,
        certificate_chain=Path(own).read_bytes() if own else None)
    return grpc.aio.secure_channel(target, credentials, options=options)


def server_options(settings: ServiceSettings) -> list[tuple[str, int]]:
    # no SO_REUSEPORT (gRPC's default is on): a second server on a port in use must fail to start, not share the
    # port and answer half its callers with another service's "Method not found"
    options = channel_options(settings) + [("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                                           ("grpc.so_reuseport", 0)]
    if settings.max_connection_age_s:
        # GOAWAY after the age; the grace lets open streams (a whole generation) finish on the old connection
        options += [("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", 2**31 - 1)]
    return options


class LoadServicer(common_pb2_grpc.LoadServicer):
    """`cosine.common.v1.Load/Report`: readiness and load in one cheap call, for callers that pick replicas."""

    def __init__(self, service: "GrpcService"):
        self.service = service

    async def Report(self, request, context):
        report = self.service.report_load()
        report.ready = self.service.ready
        return report


class GrpcService:
    """A running service: start it, mark it ready, stop it gracefully.

    `register(server)` adds the servicers and returns their full service names
    (for reflection and health). `on_stop` runs after the server stopped; `on_drain`
    (when given) runs on stop after readiness went NOT_SERVING and before the server
    stops taking calls (a scheduler hands its requests over there).
    """

    def __init__(
        self,
        name: str,
        settings: ServiceSettings,
        register: Callable[[grpc.aio.Server], Iterable[str]],
        on_stop: Callable[[], Awaitable[None]] | None = None,
        on_drain: Callable[[], Awaitable[None]] | None = None,
    ):
        self.name = name
        self.settings = settings
        self.metrics = ServiceMetrics(name)
        self.tracing = Tracing.from_settings(name, settings)
        self._interceptor = ErrorInterceptor(on_done=self.metrics.record_rpc)
        self.metrics.in_flight.labels(name).set_function(lambda: self._interceptor.in_flight)
        self._register = register
        self._on_stop = on_stop
        self._on_drain = on_drain
        self.server: grpc.aio.Server | None = None
        self.servicer: object | None = None  # the main servicer, for introspection in tests
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.health_port: int | None = None
        self._health_server: grpc.aio.Server | None = None
        self._service_names: list[str] = []
        self._stopped = asyncio.Event()
        self._stopping = False
        self._ready = False
        self._watches: list[asyncio.Task] = []
        # what Load/Report says besides readiness; services holding requests or a model thread set their own
        self.report_load: Callable[[], common_pb2.LoadReport] = self._default_load

    def _default_load(self) -> common_pb2.LoadReport:
        calls = max(0, self.in_flight - 1)  # calls in flight, less this report itself
        return common_pb2.LoadReport(live_requests=calls, queued=calls)

    @property
    def ready(self) -> bool:
        return self._ready and not self._stopping

    @property
    def in_flight(self) -> int:
        return self._interceptor.in_flight

    async def start(self) -> int:
        """Bind, start serving; health is NOT_SERVING for readiness until `set_ready()`."""
        # tracing first (when on): its span covers the error mapping and sees the final status
        interceptors = [*self.tracing.interceptors(), self._interceptor]
        self.server = grpc.aio.server(interceptors=interceptors, options=server_options(self.settings))
        self._service_names = list(self._register(self.server))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        common_pb2_grpc.add_LoadServicer_to_server(LoadServicer(self), self.server)
        reflection.enable_server_reflection(
            [*self._service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             common_pb2.DESCRIPTOR.services_by_name["Load"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        address = f"{self.settings.host}:{self.settings.port}"
        credentials = server_credentials(self.settings)
        self.port = self.server.add_secure_port(address, credentials) if credentials else self.server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"{self.name}: cannot listen on {self.settings.host}:{self.settings.port}")
        await self.server.start()
        if self.settings.health_port is not None:
            # health alone, in plaintext: the kubelet's gRPC probes when the service port speaks TLS
            self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            self.health_port = self._health_server.add_insecure_port(f"{self.settings.host}:{self.settings.health_port}")
            if self.health_port == 0:
                raise RuntimeError(f"{self.name}: cannot listen on {self.settings.host}:{self.settings.health_port}")
            await self._health_server.start()
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._set_ready(False)
        if self.settings.metrics_port is not None:
            self.metrics.serve(self.settings.host, self.settings.metrics_port)
        log.info("%s listening on %s:%d%s", self.name, self.settings.host, self.port, " (TLS)" if credentials else "")
        return self.port

    async def _set_ready(self, ready: bool) -> None:
        self._ready = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", READINESS, *self._service_names):
            await self.health.set(service, status)

    async def set_ready(self) -> None:
        await self._set_ready(True)
        log.info("%s ready", self.name)

    def watch_readiness(self, what: str, check: Callable[[], Awaitable[bool] | bool], interval_s: float) -> None:
        """Readiness follows a dependency: NOT_SERVING while ``check()`` says False, SERVING again when it
        says True (never after stop() began)."""
        self._watch(what, check, interval_s, lambda: self._ready, self._set_ready, "ready", "not ready")

    def watch_liveness(self, what: str, check: Callable[[], Awaitable[bool] | bool], interval_s: float) -> None:
        """Liveness follows ``check()`` (say, a model thread that stopped answering): NOT_SERVING tells the
        orchestrator to restart the process."""
        state = {"live": True}

        async def set_live(live: bool) -> None:
            state["live"] = live
            await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING if live else health_pb2.HealthCheckResponse.NOT_SERVING)
        self._watch(what, check, interval_s, lambda: state["live"], set_live, "live", "not live")

    def _watch(self, what, check, interval_s, current, apply, good: str, bad: str) -> None:
        async def watch():
            while not self._stopping:
                ok = check()
                if inspect.isawaitable(ok):
                    ok = await ok
                if not self._stopping and bool(ok) != current():
                    await apply(bool(ok))
                    (log.info if ok else log.warning)("%s %s: %s %s", self.name, good if ok else bad, what,
                                                      "is fine again" if ok else "failed its check")
                await asyncio.sleep(interval_s)
        self._watches.append(asyncio.get_running_loop().create_task(watch()))

    async def stop(self) -> None:
        """NOT_SERVING → wait shutdown_delay_s → drain in-flight calls up to drain_timeout_s → stop."""
        if self.server is None or self._stopped.is_set():
            return
        self._stopping = True
        for task in self._watches:
            task.cancel()
        await self._set_ready(False)
        if self.settings.shutdown_delay_s:
            await asyncio.sleep(self.settings.shutdown_delay_s)
        log.info("%s draining %d in-flight calls (up to %.1fs)", self.name, self.in_flight, self.settings.drain_timeout_s)
        if self._on_drain is not None:
            try:
                await asyncio.wait_for(self._on_drain(), self.settings.drain_timeout_s)
            except Exception:  # noqa: BLE001 - what is left is cut by the server's grace below
                log.warning("%s: drain hook did not finish", self.name, exc_info=True)
        await self.server.stop(grace=self.settings.drain_timeout_s)
        if self._health_server is not None:
            await self._health_server.stop(grace=None)
        if self._on_stop is not None:
            await self._on_stop()
        self.metrics.close()
        self.tracing.shutdown()
        self._stopped.set()
        log.info("%s stopped", self.name)

    async def run_until_signal(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop gracefully."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        await stop_requested.wait()
        await self.stop()


def run_service(settings_cls: type[ServiceSettings], serve: Callable, argv: list[str] | None = None,
                refuse: tuple[type[BaseException], ...] = ()) -> None:
    """The start-up of every service's __main__: settings from argv and environment, logging,
    `serve(settings)`, then serve until SIGTERM. Exceptions in `refuse` exit with status 2."""
    import sys

    settings = settings_cls.load(sys.argv[1:] if argv is None else argv)
    setup_logging(settings.log_level)

    async def run():
        try:
            service = await serve(settings)
        except refuse as exc:
            log.error("refusing to start: %s", exc)
            raise SystemExit(2) from exc
        await service.run_until_signal()

    asyncio.run(run())


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
