"""cosine.common.pool against real gRPC servers on port 0: load reports, health, targets that change."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from cosine.cluster import free_port
from cosine.common.config import ServiceSettings
from cosine.common.errors import ServiceError
from cosine.common.pool import EndpointPool, parse_targets, write_targets_file
from cosine.common.server import GrpcService
from cosine.common.v1 import common_pb2

FAST = dict(pool_poll_interval_s=0.1, pool_resolve_interval_s=0.2)


async def replica(name: str, live: int = 0, ready: bool = True, port: int = 0) -> GrpcService:
    service = GrpcService(name, ServiceSettings(port=port, drain_timeout_s=0.1), lambda server: [])
    service.load_now = live
    service.report_load = lambda: common_pb2.LoadReport(live_requests=service.load_now, capacity=8)
    await service.start()
    if ready:
        await service.set_ready()
    return service


async def until(check, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_targets_parse():
    assert parse_targets("a:1, b:2") == ("list", "a:1,b:2")
    assert parse_targets("ipv4:127.0.0.1:1,127.0.0.1:2") == ("list", "127.0.0.1:1,127.0.0.1:2")
    assert parse_targets("dns:///verifier.ns.svc:50054") == ("dns", "verifier.ns.svc:50054")
    assert parse_targets("file:/tmp/x") == ("file", "/tmp/x")
    assert parse_targets("file:///tmp/x") == ("file", "/tmp/x")
    for bad in ("", "dns:///nohost", "a:1,,b:2", "file:"):
        with pytest.raises(ValueError):
            parse_targets(bad)


async def test_picks_the_least_loaded_and_spreads_equal_replicas():
    a, b = await replica("a", live=5), await replica("b", live=1)
    pool = EndpointPool("verifier", f"127.0.0.1:{a.port},127.0.0.1:{b.port}", ServiceSettings(**FAST))
    await pool.start()
    try:
        first, second = pool.endpoints()
        assert [e.healthy for e in pool.endpoints()] == [True, True]
        assert first.name == "verifier-0" and first.report.live_requests == 5
        picks = [pool.pick() for _ in range(4)]  # b holds 1 and a 5: b takes requests until they level
        assert picks == [second] * 4 and second.placed == 4
        for endpoint in picks:
            pool.release(endpoint)
        assert second.placed == 0
        a.load_now = b.load_now = 2
        await asyncio.sleep(0.35)
        assert first.load.live == second.load.live == 2
        names = [pool.pick().name for _ in range(6)]
        assert names.count("verifier-0") == names.count("verifier-1") == 3
    finally:
        await pool.close()
        await a.stop()
        await b.stop()


async def test_a_replica_down_or_not_ready_takes_nothing_and_comes_back():
    a, b = await replica("a"), await replica("b", ready=False)
    pool = EndpointPool("verifier", f"127.0.0.1:{a.port},127.0.0.1:{b.port}", ServiceSettings(**FAST))
    await pool.start()
    try:
        ea, eb = pool.endpoints()
        assert not eb.healthy and {pool.pick() for _ in range(4)} == {ea}
        await b.set_ready()
        await until(lambda: eb.healthy)
        pool.mark_down(ea)
        assert {pool.pick() for _ in range(4)} == {eb}
        await until(lambda: ea.healthy)  # its next poll passes: re-admitted
        await a.stop()
        await until(lambda: not ea.healthy)
        await b.stop()
        await until(lambda: not eb.healthy)
        with pytest.raises(ServiceError) as failed:
            pool.pick()
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert "no verifier replica is reachable" in failed.value.message
        assert not re.search(r"\d+\.\d+\.\d+\.\d+|:\d{3,5}", failed.value.message)
    finally:
        await pool.close()
        await a.stop()
        await b.stop()


async def test_a_replica_that_starts_after_its_caller_is_taken_into_use_within_the_reconnect_backoff():
    """Every process of `cosine up` starts at once: a caller polls replicas that are still loading their models.
    Its channel must keep trying at most reconnect_backoff_max_s apart; gRPC's default backoff (1 s growing 1.6x
    to 120 s) left a replica that came up 3 s late unseen for another ~2 s (a CI run: 83% of the load on one)."""
    port = free_port()
    settings = ServiceSettings(reconnect_backoff_max_s=0.2, **FAST)
    pool = EndpointPool("drafter", f"127.0.0.1:{port}", settings)
    await pool.start()
    late = None
    try:
        (endpoint,) = pool.endpoints()
        await asyncio.sleep(3.0)  # the caller's tries fail meanwhile
        assert not endpoint.healthy
        late = await replica("late", port=port)
        up = asyncio.get_running_loop().time()
        await until(lambda: endpoint.healthy, timeout=1.0)  # backoff 0.2 s + poll 0.1 s, with room
        print(f"taken into use {asyncio.get_running_loop().time() - up:.2f}s after it was ready")
    finally:
        await pool.close()
        if late is not None:
            await late.stop()


async def test_a_replica_added_to_the_targets_file_joins_and_one_removed_leaves(tmp_path):
    a, b = await replica("a", live=3), await replica("b")
    path = tmp_path / "verifier.targets"
    write_targets_file(path, [f"127.0.0.1:{a.port}"])
    pool = EndpointPool("verifier", f"file:{path}", ServiceSettings(**FAST))
    await pool.start()
    try:
        assert len(pool.endpoints()) == 1
        write_targets_file(path, [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"])
        await until(lambda: len(pool.endpoints()) == 2, timeout=3)
        assert pool.pick().name == "verifier-1"  # the new, idle one
        held = pool.pick(exclude=frozenset({"verifier-1"}))  # a request of ours on the replica about to leave
        write_targets_file(path, [f"127.0.0.1:{b.port}"])
        await until(lambda: len(pool.endpoints()) == 1, timeout=3)
        assert pool.endpoints()[0].name == "verifier-1"
        await asyncio.sleep(0.5)
        assert held.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN  # its streams may go on
        pool.release(held)
        await until(lambda: held.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN, timeout=3)
    finally:
        await pool.close()
        await a.stop()
        await b.stop()


async def test_dns_target_resolves_every_address():
    a = await replica("a")
    pool = EndpointPool("fusion", f"dns:///localhost:{a.port}", ServiceSettings(**FAST))
    await pool.start()
    try:
        # localhost may name ::1 too, where nothing listens: that endpoint is simply never healthy
        assert f"127.0.0.1:{a.port}" in [e.address for e in pool.endpoints()]
        assert pool.pick().address == f"127.0.0.1:{a.port}"
        with pytest.raises(ServiceError):
            pool.pick(exclude=frozenset(e for e in pool.endpoints() if e.healthy))
    finally:
        await pool.close()
        await a.stop()


async def test_a_second_server_on_a_port_in_use_fails_to_start_instead_of_sharing_it():
    """gRPC servers default to SO_REUSEPORT: two services on one port would split its callers between them."""
    import grpc

    from cosine.common.config import ServiceSettings
    from cosine.common.server import server_options

    options = server_options(ServiceSettings(port=0))
    first = grpc.aio.server(options=options)
    port = first.add_insecure_port("127.0.0.1:0")
    await first.start()
    try:
        second = grpc.aio.server(options=options)
        with pytest.raises(RuntimeError):
            second.add_insecure_port(f"127.0.0.1:{port}")
    finally:
        await first.stop(None)


def test_free_port_never_hands_out_a_port_twice():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
