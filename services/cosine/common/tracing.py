"""OpenTelemetry tracing of every service: set up from settings, W3C context carried over gRPC.

One `Tracing` per service (its own TracerProvider, so services sharing a process
keep their own `service.name`; no global provider is set). With the exporter
`none` nothing is created: `span()` hands back one shared no-op context, the
server interceptor is not installed, and nothing is injected into calls.

How context travels:
  - a call's metadata (`traceparent`/`tracestate`): `TracingInterceptor` on every
    server extracts it and opens a SERVER span around the handler; callers add
    `tracing.metadata()` to the calls they make;
  - in-band, per message, on the per-request bidi streams: each round message has
    a `trace_context` map, filled with `tracing.inject(msg.trace_context)`, so the
    peer's round span is a child of the caller's round, not of the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cosine.common.errors import rewrap

if TYPE_CHECKING:
    from cosine.common.config import ServiceSettings

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
# what `span()` returns when tracing is off: reusable, and its span ignores every call
_OFF = contextlib.nullcontext(trace.INVALID_SPAN)


class Tracing:
    """The tracer of one service, or nothing at all when off."""

    def __init__(self, service: str, exporter: str = "none", otlp_endpoint: str = "", sample_ratio: float = 1.0):
        self.service = service
        self.enabled = exporter != "none"
        self.memory = None  # the InMemorySpanExporter with exporter "memory"
        self._provider = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        resource = Resource.create({"service.name": service, "service.namespace": "cosine"})
        self._provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        if exporter == "memory":
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            self.memory = InMemorySpanExporter()
            self._provider.add_span_processor(SimpleSpanProcessor(self.memory))
        elif exporter == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            self._provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(service_name=service)))
        elif exporter == "otlp":
            self._provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(otlp_endpoint)))
        else:
            raise ValueError(f"unknown trace exporter {exporter!r}: none, console, otlp or memory")
        self.tracer = self._provider.get_tracer("cosine")
        log.info("%s: tracing on, exporter %s%s", service, exporter, f" ({otlp_endpoint})" if otlp_endpoint else "")

    @classmethod
    def from_settings(cls, service: str, settings: ServiceSettings) -> Tracing:
        return cls(service, settings.trace_exporter, settings.otlp_endpoint, settings.trace_sample_ratio)

    def span(self, name: str, attributes: Mapping[str, Any] | None = None, parent: Mapping[str, str] | None = None):
        """A context manager around an INTERNAL span, current while it is open.

        `parent`: a carrier filled by `inject()` on the other side (a message's
        `trace_context`); empty or None: the current span is the parent.
        """
        if not self.enabled:
            return _OFF
        ctx = _PROPAGATOR.extract(parent) if parent else None
        return self.tracer.start_as_current_span(name, context=ctx, attributes=attributes)

    def start(self, name: str, attributes: Mapping[str, Any] | None = None,
              parent: trace.Span | Mapping[str, str] | None = None) -> trace.Span:
        """An INTERNAL span that is *not* made current (end it with ``span.end()``): for work that spans
        several tasks, such as a request's round in the scheduler's step loop. `parent`: a span, or a
        carrier filled by `inject()`/`carrier()`; None: the current span."""
        if not self.enabled:
            return trace.INVALID_SPAN
        if isinstance(parent, trace.Span):
            ctx = trace.set_span_in_context(parent)
        else:
            ctx = _PROPAGATOR.extract(parent) if parent else None
        return self.tracer.start_span(name, context=ctx, attributes=attributes)

    def carrier(self, span: trace.Span | None = None, into: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
        """The trace context of `span` (None: the current span) written into `into` (a message's map) or a new dict."""
        into = {} if into is None else into
        if self.enabled:
            _PROPAGATOR.inject(into, context=trace.set_span_in_context(span) if span is not None else None)
        return into

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        """Write the current span's context into carrier (a protobuf map field works)."""
        if self.enabled:
            _PROPAGATOR.inject(carrier)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """gRPC metadata carrying the current span's context, for an outgoing call (None when off)."""
        if not self.enabled:
            return None
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return tuple(carrier.items()) or None

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TracingInterceptor(self)] if self.enabled else []

    def shutdown(self) -> None:
        """Flush what is queued and stop the exporter."""
        if self._provider is not None:
            self._provider.shutdown()


def _otlp_exporter(endpoint: str):
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:  # pragma: no cover - it is a dependency; a slimmed image may lack it
        raise RuntimeError("trace_exporter otlp needs opentelemetry-exporter-otlp-proto-grpc installed") from exc
    insecure = not endpoint.startswith("https://")
    return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)


def set_span_attributes(attributes: Mapping[str, Any]) -> None:
    """Add attributes to the current span (no-op when it does not record)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Opens a SERVER span per call, child of the caller's context from the call's metadata.

    The span is current for the whole handler (grpc.aio runs every call in its own
    task, so the attached context stays with that call). Installed only when tracing is on.
    """

    def __init__(self, tracing: Tracing):
        self.tracing = tracing

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        # health, reflection and the load polls of callers' pools (every 0.5 s): no trace
        if handler is None or method.startswith("/grpc.") or method.startswith("/cosine.common.v1.Load/"):
            return handler
        return rewrap(handler, handler_call_details.method, self._wrap_unary, self._wrap_stream)

    def _start(self, method: str, context: grpc.aio.ServicerContext):
        carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        parent = _PROPAGATOR.extract(carrier)
        service, _, name = method.lstrip("/").partition("/")
        span = self.tracing.tracer.start_span(
            method.lstrip("/"), context=parent, kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        return span, token

    @staticmethod
    def _end(span, token, code: grpc.StatusCode) -> None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            span.set_status(Status(StatusCode.ERROR, code.name))
        span.end()
        try:
            otel_context.detach(token)
        except Exception:  # noqa: BLE001 - a handler closed from another task: its context dies with it
            pass

    def _wrap_unary(self, behavior, method: str):
        async def wrapper(request, context: grpc.aio.ServicerContext):
            span, token = self._start(method, context)
            code = grpc.StatusCode.OK
            try:
                return await behavior(request, context)
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                self._end(span, token, code)

        return wrapper

    def _wrap_stream(self, behavior, method: str):
        async def wrapper(request, context: grpc.aio.ServicerContext):
            span, token = self._start(method, context)
            code = grpc.StatusCode.OK
            responses = behavior(request, context)
            try:
                async for response in responses:
                    yield response
            except BaseException as exc:
                cancelled = isinstance(exc, (GeneratorExit, asyncio.CancelledError))
                code = grpc.StatusCode.CANCELLED if cancelled else (context.code() or grpc.StatusCode.UNKNOWN)
                raise
            finally:
                await responses.aclose()
                self._end(span, token, code)

        return wrapper

