"""A peer that ends a bidi stream with an error: the caller sees the peer's status, not INTERNAL."""

from __future__ import annotations

import grpc
import pytest

from cosine.common.errors import ServiceError
from cosine.common.streams import exchange


async def _refuse(request_iterator, context):
    async for _ in request_iterator:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV slot")
    yield b""  # never reached: makes this an async generator handler


async def test_a_stream_the_peer_ended_reports_the_peers_status():
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(_refuse)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Peer", {"Talk": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/test.Peer/Talk")()
            with pytest.raises(grpc.aio.AioRpcError) as first:
                await exchange(call, b"open", "verifier")  # the refusal arrives at the read (the error interceptor passes it on)
            assert first.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(ServiceError) as second:
                await exchange(call, b"round", "verifier")  # writing to the ended call
            assert second.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "no free KV slot" in second.value.message
    finally:
        await server.stop(None)
