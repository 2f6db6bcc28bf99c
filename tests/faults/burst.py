"""A burst of Generate streams at once from a process of its own, as a client of the router is: it reads
{"address", "max_new_tokens", "prompts"} as JSON on stdin and prints, as one JSON list, each stream's
[status code name, token ids, seconds to its end or its error, error details]. The timing is then the
client's and the router's alone, not that of the services the test runs in its own process."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc

from cosine.router.v1 import router_pb2, router_pb2_grpc


async def one(stub, prompt: str, max_new_tokens: int) -> list:
    started = time.perf_counter()
    ids: list[int] = []
    try:
        request = router_pb2.GenerateRequest(prompt=prompt.encode(), max_new_tokens=max_new_tokens)
        async for reply in stub.Generate(request, timeout=120):
            if reply.WhichOneof("kind") == "chunk":
                ids += reply.chunk.token_ids
    except grpc.aio.AioRpcError as exc:
        return [exc.code().name, ids, time.perf_counter() - started, exc.details()]
    return ["OK", ids, time.perf_counter() - started, ""]


async def burst(address: str, prompts: list[str], max_new_tokens: int) -> list[list]:
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = router_pb2_grpc.RouterStub(channel)
        return list(await asyncio.gather(*(one(stub, p, max_new_tokens) for p in prompts)))


if __name__ == "__main__":
    spec = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(burst(spec["address"], spec["prompts"], spec["max_new_tokens"]))))
