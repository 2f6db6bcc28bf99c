"""Errors that carry a gRPC status, and the interceptor that turns exceptions into statuses."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

# Statuses of a downstream call that are passed on as they are; anything else becomes INTERNAL.
_PASSED_ON = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
}


class ServiceError(Exception):
    """An error for the caller: its status and a message that tells what to do."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


# gRPC's own transport errors (they name addresses and socket calls) and addresses of any form
_TRANSPORT = re.compile(
    r"failed to connect to all addresses|last error:|socket closed|connection reset|connection refused|stream removed|"
    r"recvmsg|sendmsg|goaway|keepalive|dns resolution|broken pipe|connection attempt timed out|\b(?:ipv4|ipv6|unix|dns):", re.I)
_ADDRESS = re.compile(
    r"\b(?:ipv4|ipv6|unix|unix-abstract|dns):\S*|\[[0-9a-f:.]+\](?::\d+)?|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|"
    r"\b(?:localhost|[a-z0-9-]+(?:\.[a-z0-9-]+)+):\d{2,5}\b", re.I)


def sanitize(message: str) -> str:
    """A message fit for a caller outside: gRPC's transport errors become one plain sentence, and no
    address of another service (IP, host:port, unix socket) is left in it."""
    found = _TRANSPORT.search(message)
    if found:
        prefix = message[:found.start()].rstrip(" :;,(")
        plain = "the connection to a backend service failed; retry"
        message = f"{prefix}: {plain}" if prefix else plain
    return _ADDRESS.sub("(a backend)", message)


def broken_stream(exc: grpc.aio.AioRpcError) -> bool:
    """True when a call failed in transport (the server died, its connection dropped, or it cut the call while
    stopping) rather than with a status the server chose: such a call can be resumed elsewhere. A CoSine
    server's own statuses never look like this: `sanitize` rewrites transport texts before they leave it."""
    code = exc.code()
    if code == grpc.StatusCode.CANCELLED:  # the server cancelled it (the caller's own cancel is no AioRpcError)
        return True
    return code == grpc.StatusCode.UNAVAILABLE and bool(_TRANSPORT.search(exc.details() or ""))


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a caller sees for exc; internals (addresses, exception text) never leak."""
    code, message = _status_of(exc)
    clean = sanitize(message)
    if clean != message:
        log.info("error message sanitized for the caller: %s", message)
    return code, clean


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, grpc.aio.AioRpcError):
        if exc.code() in _PASSED_ON:
            return exc.code(), exc.details() or exc.code().name
        incident = uuid.uuid4().hex[:8]
        log.error("downstream call failed (incident %s): %s %s", incident, exc.code(), exc.details())
        return grpc.StatusCode.INTERNAL, f"internal error in a backend service (incident {incident})"
    incident = uuid.uuid4().hex[:8]
    log.exception("unhandled error (incident %s)", incident, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (incident {incident}; see the server log)"


def rewrap(handler, method: str, wrap_unary: Callable, wrap_stream: Callable):
    """The same RPC handler with its behaviour wrapped: `wrap_unary(behavior, method)` for
    unary-unary calls, `wrap_stream(behavior, method)` for server- and bidi-streaming ones
    (the kinds CoSine serves). Shared by the server interceptors."""
    if handler is None:
        return None
    for kind, make, wrap in (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, wrap_unary),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, wrap_stream),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, wrap_stream),
    ):
        behavior = getattr(handler, kind)
        if behavior:
            return make(wrap(behavior, method), request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler  # stream_unary: none of ours


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by a handler to a gRPC status without leaking internals.

    Also counts in-flight calls so a draining server can report them, and records
    each call's outcome with `on_done(method, code, seconds)` when given.
    """

    def __init__(self, on_done: Callable[[str, grpc.StatusCode, float], None] | None = None):
        self.in_flight = 0
        self._on_done = on_done

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return rewrap(handler, handler_call_details.method, self._wrap_unary, self._wrap_stream)

    def _done(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.in_flight -= 1
        if self._on_done is not None:
            self._on_done(method, code, time.perf_counter() - started)

    def _wrap_unary(self, behavior: Callable[..., Any], method: str):
        async def wrapper(request, context: grpc.aio.ServicerContext):
            self.in_flight += 1
            started, code = time.perf_counter(), grpc.StatusCode.OK
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except Exception as exc:  # noqa: BLE001 - every error becomes a status
                code, message = status_of(exc)
                await context.abort(code, message)
            finally:
                self._done(method, code, started)

        return wrapper

    def _wrap_stream(self, behavior: Callable[..., AsyncIterator[Any]], method: str):
        async def wrapper(request, context: grpc.aio.ServicerContext):
            self.in_flight += 1
            started, code = time.perf_counter(), grpc.StatusCode.OK
            responses = behavior(request, context)
            try:
                async for response in responses:
                    yield response
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:  # noqa: BLE001 - every error becomes a status
                code, message = status_of(exc)
                await context.abort(code, message)
            finally:
                # a cancelled stream leaves the handler suspended at a yield: close it so its own
                # clean-up (releasing caches, closing downstream calls) runs now, not at garbage collection
                await responses.aclose()
                self._done(method, code, started)

        return wrapper
