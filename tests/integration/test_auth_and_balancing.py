"""What the chart's wiring relies on in the services, on real servers on port 0: the router's API key
(read from a file, as the chart mounts it from a Secret), client-side round-robin over several
addresses, and max_connection_age asking long-lived clients to reconnect without cutting open streams."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cosine.common.config import ServiceSettings
from cosine.common.server import GrpcService, channel_options
from cosine.router.__main__ import RouterSettings
from cosine.router.__main__ import serve as serve_router
from cosine.router.v1 import router_pb2, router_pb2_grpc

KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
async def keyed_router(services, tiny_dirs, tmp_path_factory):
    """A second router in front of the same scheduler and fusion, with an API key file."""
    keyfile = tmp_path_factory.mktemp("keys") / "api-keys"
    keyfile.write_text(json.dumps([KEY, "second-key-abcdefgh"]))
    router = await serve_router(RouterSettings(
        scheduler=f"127.0.0.1:{services['scheduler'].port}", fusion=f"127.0.0.1:{services['fusion'].port}",
        model=str(tiny_dirs["target"]), port=0, drain_timeout_s=1.0, api_keys_file=str(keyfile)))
    yield f"127.0.0.1:{router.port}"
    await router.stop()


async def generate(address: str, metadata=None) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        ids = []
        request = router_pb2.GenerateRequest(prompt=b"The quick brown fox", max_new_tokens=12)
        async for reply in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60, metadata=metadata):
            if reply.WhichOneof("kind") == "chunk":
                ids += reply.chunk.token_ids
        return ids


async def test_without_the_key_generate_is_unauthenticated(keyed_router):
    for metadata in (None, (("authorization", "Bearer wrong-key"),), (("authorization", KEY),)):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await generate(keyed_router, metadata)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert "authorization: Bearer" in exc.value.details()


async def test_with_the_key_generation_works_and_matches_the_open_router(keyed_router, services):
    unkeyed = await generate(services.router)
    assert unkeyed
    for key in (KEY, "second-key-abcdefgh"):
        assert await generate(keyed_router, (("authorization", f"Bearer {key}"),)) == unkeyed


async def test_health_and_reflection_need_no_key(keyed_router):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with grpc.aio.insecure_channel(keyed_router) as channel:
        for name in ("liveness", "readiness"):
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = [r async for r in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
        assert "cosine.router.v1.Router" in {s.name for s in replies[0].list_services_response.service}


def test_a_malformed_key_file_is_refused(tmp_path):
    bad = tmp_path / "keys"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="JSON list"):
        RouterSettings(api_keys_file=str(bad)).accepted_keys()
    assert RouterSettings(api_keys=["a"]).accepted_keys() == {"a"}


# ---- spreading and rebalancing


async def echo(requests, context):
    async for r in requests:
        yield r


def register_echo(server):
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}),))
    return ["test.Echo"]


async def start(max_connection_age_s: float = 0.0) -> GrpcService:
    service = GrpcService("echo", ServiceSettings(port=0, drain_timeout_s=0.1, max_connection_age_s=max_connection_age_s), register_echo)
    await service.start()
    await service.set_ready()
    return service


def echo_calls(service: GrpcService) -> float:
    return service.metrics.registry.get_sample_value("cosine_rpc_total", {"service": "echo", "method": "Echo", "code": "OK"}) or 0.0


async def one_stream(channel, payload: bytes = b"x") -> bytes:
    call = channel.stream_stream("/test.Echo/Echo")()
    await call.write(payload)
    reply = await call.read()
    await call.done_writing()
    await call.code()
    return reply


async def test_channels_between_services_spread_streams_over_every_address():
    """A dns:/// name of a headless Service resolves to every pod; an ipv4: list of two addresses stands in here."""
    replicas = [await start(), await start()]
    try:
        target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in replicas)
        async with grpc.aio.insecure_channel(target, options=channel_options(ServiceSettings())) as channel:
            await channel.channel_ready()
            for _ in range(40):
                assert await one_stream(channel) == b"x"
        counts = [echo_calls(s) for s in replicas]
        assert sum(counts) == 40 and all(12 <= c <= 28 for c in counts), counts  # 30-70% each
        # pick_first (gRPC's default, what callers had): every stream on one replica
        async with grpc.aio.insecure_channel(target) as channel:
            for _ in range(10):
                await one_stream(channel)
        moved = [echo_calls(s) - c for s, c in zip(replicas, counts)]
        assert sorted(moved) == [0, 10], moved
    finally:
        for s in replicas:
            await s.stop()


async def test_max_connection_age_moves_new_calls_off_old_connections_and_keeps_open_streams():
    async def states(max_age: float) -> tuple[list[str], bytes]:
        service = await start(max_age)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
                call = channel.stream_stream("/test.Echo/Echo")()
                await call.write(b"first")
                assert await call.read() == b"first"
                await asyncio.sleep(max_age * 3 if max_age else 1.5)
                await call.write(b"after")  # the open stream outlives the GOAWAY (the grace is unbounded)
                later = await call.read()
                await call.done_writing()
                await call.code()
                seen = []
                for _ in range(6):
                    seen.append(channel.get_state(try_to_connect=False).name)
                    await asyncio.sleep(0.1)
                assert await one_stream(channel, b"new") == b"new"  # new calls reconnect
                return seen, later
        finally:
            await service.stop()

    aged, later = await states(0.5)
    assert later == b"after"
    # the server closed the connection once the stream ended: the channel would re-resolve and reconnect
    assert "IDLE" in aged, aged
    kept, later = await states(0.0)
    assert later == b"after" and set(kept) == {"READY"}, kept
