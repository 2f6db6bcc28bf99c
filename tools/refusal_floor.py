"""The floor under `cosine bench faults --concurrency N`'s refusal times: N Generate streams at once, from one
Python client, against a gRPC server that refuses every one at once (RESOURCE_EXHAUSTED through CoSine's
own ErrorInterceptor, no model, no other service). Prints, per burst, the p50 and slowest refusal as the
client sees them, and the CPU seconds the server and the client spent on the burst: what gRPC's Python
stack costs per call on this machine, before any CoSine work.

    PYTHONPATH=services python tools/refusal_floor.py [--streams 200] [--bursts 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import time

import grpc

from cosine.common.errors import ErrorInterceptor, ServiceError
from cosine.router.v1 import router_pb2, router_pb2_grpc


class Refuser(router_pb2_grpc.RouterServicer):
    async def Generate(self, request, context):
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the server is at capacity; retry later, with backoff")
        yield  # an async generator, as the router's Generate is


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def serve(port_out, cpu_in, cpu_out) -> None:
    async def main():
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        router_pb2_grpc.add_RouterServicer_to_server(Refuser(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_out.put(port)
        while True:  # answer the client's CPU readings between bursts
            await asyncio.to_thread(cpu_in.get)
            cpu_out.put(cpu_s())
    asyncio.run(main())


async def bursts(port: int, streams: int, count: int, cpu_in, cpu_out) -> None:
    async def one(stub) -> tuple[float, str]:
        started = time.perf_counter()
        try:
            async for _ in stub.Generate(router_pb2.GenerateRequest(prompt=b"x", max_new_tokens=4), timeout=30):
                pass
        except grpc.aio.AioRpcError as exc:
            return time.perf_counter() - started, exc.code().name
        return time.perf_counter() - started, "OK"

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        stub = router_pb2_grpc.RouterStub(channel)
        await asyncio.gather(*(one(stub) for _ in range(8)))  # warm-up
        print(f"{streams} streams at once, one client process, a server that refuses each at once")
        print(f"{'burst':>5} {'refusal p50':>12} {'slowest':>9} {'server CPU':>11} {'client CPU':>11}")
        for i in range(count):
            await asyncio.sleep(0.5)
            cpu_in.put(None)
            server0, client0 = await asyncio.to_thread(cpu_out.get), cpu_s()
            results = await asyncio.gather(*(one(stub) for _ in range(streams)))
            cpu_in.put(None)
            server1, client1 = await asyncio.to_thread(cpu_out.get), cpu_s()
            codes = {code for _, code in results}
            if codes != {"RESOURCE_EXHAUSTED"}:
                raise SystemExit(f"unexpected statuses: {codes}")
            times = sorted(t for t, _ in results)
            print(f"{i + 1:>5} {times[len(times) // 2] * 1000:>9.0f} ms {times[-1] * 1000:>6.0f} ms "
                  f"{(server1 - server0) * 1000:>8.0f} ms {(client1 - client0) * 1000:>8.0f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=200, help="streams per burst")
    ap.add_argument("--bursts", type=int, default=5)
    args = ap.parse_args()
    port_q, cpu_in, cpu_out = mp.Queue(), mp.Queue(), mp.Queue()
    server = mp.Process(target=serve, args=(port_q, cpu_in, cpu_out), daemon=True)
    server.start()
    try:
        asyncio.run(bursts(port_q.get(timeout=30), args.streams, args.bursts, cpu_in, cpu_out))
    finally:
        server.kill()
        server.join()


if __name__ == "__main__":
    main()
