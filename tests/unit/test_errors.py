"""Error messages that reach a caller carry no address of another service and no transport internals."""

from __future__ import annotations

import grpc
import pytest

from cosine.common.errors import ServiceError, sanitize, status_of


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize("raw", [
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50061: Failed to connect to remote host: Connection refused",
    "drafter lm-code ended the stream early: failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.3.7:50061",
    "fusion is unreachable: failed to connect to all addresses; last error: UNAVAILABLE: unix:/tmp/fusion.sock: No such file",
    "Socket closed",
    "a drafter failed: Stream removed (Socket closed)",
    "cannot reach cosine-verifier.prod.svc.cluster.local:50054 right now",
    "peer [2001:db8::1]:443 went away",
    "verifier at 192.168.1.20:50054 is full; retry later",
])
def test_no_address_or_transport_text_survives(raw):
    clean = sanitize(raw)
    for leak in ("127.0.0.1", "10.0.3.7", "ipv4:", "unix:", "50061", "50054", "cluster.local", "2001:db8", "192.168", "Socket closed"):
        assert leak not in clean
    assert clean  # still says something


def test_our_own_messages_are_kept():
    for message in ("the verifier holds 16 requests already; retry later", "request abc: its state is gone; retry the request",
                    "prompt (12 tokens) + max_new_tokens (4096) exceeds the target's context limit of 2048 tokens"):
        assert sanitize(message) == message
    assert sanitize("drafter lm-code ended the stream early: failed to connect to all addresses; last error: x") == \
        "drafter lm-code ended the stream early: the connection to a backend service failed; retry"


def test_status_of_sanitizes_passed_on_and_own_errors():
    code, message = status_of(rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: ipv4:127.0.0.1:1"))
    assert code == grpc.StatusCode.UNAVAILABLE and "127.0.0.1" not in message
    code, message = status_of(ServiceError(grpc.StatusCode.UNAVAILABLE, "fusion is unreachable: Socket closed"))
    assert code == grpc.StatusCode.UNAVAILABLE and message == "fusion is unreachable: the connection to a backend service failed; retry"
    code, message = status_of(rpc_error(grpc.StatusCode.UNKNOWN, "Exception calling application: KeyError('ipv4:10.1.1.1:5')"))
    assert code == grpc.StatusCode.INTERNAL and "10.1.1.1" not in message and "KeyError" not in message
    code, message = status_of(RuntimeError("boom at 10.2.2.2:80"))
    assert code == grpc.StatusCode.INTERNAL and "boom" not in message
