"""Prometheus metrics of one service: its own registry (no process-wide singletons) and /metrics."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServiceMetrics:
    """Metrics every service exports; services add their own to `registry`."""

    def __init__(self, service: str):
        self.service = service
        self.registry = CollectorRegistry()
        self.rpc_total = Counter(
            "cosine_rpc_total", "RPCs handled, by method and status code", ["service", "method", "code"], registry=self.registry
        )
        self.rpc_seconds = Histogram(
            "cosine_rpc_duration_seconds", "RPC wall time", ["service", "method"], buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.in_flight = Gauge("cosine_rpc_in_flight", "RPCs in progress", ["service"], registry=self.registry)
        # model services: rate(busy seconds) is the busy fraction of the model thread, 1 - that the idle fraction
        self.worker_busy_seconds = Counter(
            "cosine_worker_busy_seconds_total", "seconds the model worker thread spent running model code", ["service"], registry=self.registry)
        self.worker_queue_depth = Gauge(
            "cosine_worker_queue_depth", "model calls waiting for or running on the model worker", ["service"], registry=self.registry)
        # model services: requests that opened a KV cache here (a replica's share of the requests)
        self.requests_opened = Counter(
            "cosine_requests_opened_total", "requests that opened a KV cache on this replica", ["service"], registry=self.registry)
        self.port: int | None = None
        self._server = None

    def record_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        name = method.rsplit("/", 1)[-1]
        self.rpc_total.labels(self.service, name, code.name).inc()
        self.rpc_seconds.labels(self.service, name).observe(seconds)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics endpoint; returns the bound port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        log.info("%s metrics on http://%s:%d/metrics", self.service, host, self.port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
